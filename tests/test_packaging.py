"""A non-editable install works on its own: the wheel carries the configs, and the CLIs and the config loader run
from any working directory, with no repository around them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(args, cwd, **kwargs):
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv with the wheel installed (no-deps); the test environment's packages (torch, lightning, ...)
    are reached through a .pth file, so nothing is downloaded and this repository is not on the path."""
    root = tmp_path_factory.mktemp("wheel")
    # Built from a copy: an in-tree build would leave build/ in the checkout, and stale files there would ship.
    source = root / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
         str(source)], cwd=root)
    wheel = next((root / "dist").glob("neobert_suite-*.whl"))
    run([sys.executable, "-m", "venv", str(root / "venv")], cwd=root)
    python = root / "venv" / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    (site / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=root)
    work = root / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    return python, site, work, env


@pytest.mark.slow
def test_the_wheel_ships_its_configs_and_its_clis_run_from_anywhere(installed):
    python, site, work, env = installed
    out = run([str(python), "-c", """
import experiments, neobert
from neobert.config import config_path, load_config, packaged_config_names
from neobert.config.glue import GlueConfig
from neobert.config.pretrain import PretrainConfig
print(neobert.__file__, experiments.__file__)
print(load_config(PretrainConfig, "neobert").trainer.strategy, load_config(GlueConfig, "glue/rte").task)
print(config_path("mteb_instructions.json").is_file(), len(packaged_config_names()))
"""], cwd=work, env=env)
    files, loaded, resources = out.strip().splitlines()
    assert all(path.startswith(str(site)) for path in files.split())  # the installed copy, not the repository
    assert loaded == "deepspeed_stage_2 rte"
    assert resources.split()[0] == "True" and int(resources.split()[1]) >= 20
    help_text = run([str(python), "-m", "experiments.pretrain", "--config", "neobert", "--help"], cwd=work, env=env)
    assert "packaged config name" in help_text
    # Every other command line's --help, each run as `python -m` runs it, in one interpreter (one import of torch)
    clis = ("glue", "ner", "contrastive", "mine_negatives", "mteb", "throughput", "pseudo_perplexity", "ablations",
            "export", "offline_corpus", "gpu_check")
    out = run([str(python), "-c", f"""
import contextlib, importlib.util, io, runpy, sys
for cli in {clis!r}:
    sys.argv, shown = [cli, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(shown):
            runpy.run_module("experiments." + cli, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        print(cli, importlib.util.find_spec("experiments." + cli).origin, exit.code, "usage:" in shown.getvalue())
"""], cwd=work, env=env)
    assert [line.split() for line in out.splitlines()] == [
        [cli, str(site / "experiments" / f"{cli}.py"), "0", "True"] for cli in clis]


@pytest.mark.slow
def test_the_installed_demo_trains_from_any_working_directory(installed):
    python, _, work, env = installed
    out = run([str(python), "-m", "experiments.pretrain", "trainer.max_steps=2", "logging.progress_bar=false",
               "data.baseline_docs=0", "data.validation_docs=0", "data.num_workers=0"], cwd=work,
              env=env | {"OMP_NUM_THREADS": "1"})
    assert "final train loss" in out or "no train loss logged" in out
    assert (work / "runs" / "demo" / "export" / "model.safetensors").is_file()
    assert (work / "runs" / "demo" / "corpus.jsonl").is_file()
