# Versions the GPU folders pin, sourced by prepare_offline.sh and prepare_fa4.sh (from the repository's root).
# Both bring Liger-Kernel, and one folder may be installed over the other into the same site folder (pip --target
# skips what is there), so they must agree. 0.8.5: the version of docs/benchmarks.md's GPU figures.
LIGER_PIN=liger-kernel==0.8.5

# venv_pins NAME ...: NAME==VERSION of each distribution as this project's venv has it (what the CPU suite tests)
venv_pins() {
    .venv/bin/python -c 'import sys; from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))' "$@"
}
