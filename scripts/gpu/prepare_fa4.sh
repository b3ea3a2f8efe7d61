#!/usr/bin/env bash
# Prepares, on a machine with the package registry, FlashAttention 4 (NeoBERTConfig.attention_kernel=flash_attn_4) for
# a GPU machine without one: flash-attn-4 and what it needs beyond the GPU image (torch, triton, cuda-bindings, einops
# and protobuf are there), unpacked as `pip install --target` would and packed into one archive. CuTe DSL's compiler
# library alone is an 88 MiB wheel, over the 64 MiB a remote run may copy with the checkout; xz with its x86 filter packs the whole set
# into 56.0 MiB, so it travels in a call of its own (carry [".gpu_fa4"]; scripts/gpu/run_checks.sh unpacks it).
#   bash scripts/gpu/prepare_fa4.sh [OUT_DIR=.gpu_fa4] [PYTHON_VERSION=3.12]
# Writes OUT_DIR/site.tar.xz (4-7 minutes of xz here: one thread fits its memory limit). omegaconf, datasets, dill,
# multiprocess, torch-optimi and liger-kernel travel with it, so that the throughput job and run_checks' CUDA tests
# (steps tests and tests_fa4) run from this archive alone, with the image's transformers.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/pins.sh
OUT=${1:-.gpu_fa4}
PY=${2:-3.12}
PYTHON=.venv/bin/python
LIMIT_MIB=58  # the archive and this checkout (about 4 MiB) in one call of at most 64 MiB
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The versions this project's FA4 call was written against (neobert/model/attention.py: its public varlen function
# and _flash_attn_bwd, as 4.0.0b36 names them); CuTe DSL built for CUDA 13, as the image's torch is.
# With them, at this venv's versions, what the image lacks for the throughput job and run_checks' CUDA tests (whose
# files import the pretraining stack: datasets, dill, multiprocess, torch-optimi; a CPU rehearsal under the image's
# Python 3.12 and torch 2.11 stopped at each in turn), and Liger-Kernel for their Liger tests.
PINNED=$(venv_pins omegaconf datasets dill multiprocess torch-optimi)
PACKAGES="flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
torch-c-dlpack-ext==0.1.5 $LIGER_PIN $PINNED"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux2014_x86_64 --platform any"
$PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp $PLATFORMS \
    -d "$WORK/wheels" $PACKAGES
# --no-compile: this machine's Python would write bytecode for its own version, of no use to the GPU's 3.12 (608
# files, 22.5 MiB of the first archive)
$PYTHON -m pip install -q --no-deps --no-index --no-compile --only-binary=:all: --python-version "$PY" \
    --implementation cp $PLATFORMS --target "$WORK/site" "$WORK"/wheels/*.whl
mkdir -p "$OUT"
tar -C "$WORK/site" -cf - . | xz -T0 --x86 --lzma2=preset=9e,dict=192MiB > "$OUT/site.tar.xz.part"
mv "$OUT/site.tar.xz.part" "$OUT/site.tar.xz"
size_mib=$(( $(stat -c %s "$OUT/site.tar.xz") / 1048576 ))
echo "$OUT/site.tar.xz: ${size_mib} MiB"
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
    echo "error: ${size_mib} MiB is over the ${LIMIT_MIB} MiB that leave room for the checkout in one remote run" >&2
    exit 1
fi
