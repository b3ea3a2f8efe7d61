"""One run per output directory (docs/reliability.md, "Output directories"): a run holds its output directory for
its lifetime (`neobert.outputs.hold_output_dir`); a second run into it is refused, naming the holder, before it
writes or removes anything; a killed run's hold ends with its process; the other ranks of a run neither hold nor
refuse; the clean-up of interrupted checkpoint writes never touches a live run's files. The holder here is a real
second process: a small script that holds a directory and sleeps."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from glue_files import write_parquet_task
from test_pretrain import tiny_config

from neobert.config import ConfigError, load_config
from neobert.config.contrastive import ContrastiveConfig
from neobert.jobs.contrastive import run_contrastive
from neobert.jobs.glue import run_glue
from neobert.jobs.phases import run_phases
from neobert.jobs.pretrain import run_pretraining
from neobert.layout import RUN_LOCK, checkpoint_dir
from neobert.lit.checkpoints import resume_checkpoint
from neobert.outputs import (EXPORT, FINETUNE_TASK, claim_output_dir, clear_output_dir, hold_output_dir,
                             is_global_rank_zero)

REPO = Path(__file__).resolve().parents[1]
# The package's __init__ imports torch and transformers (seconds on a busy machine); the hold needs neither, so the
# holder imports neobert.outputs and the base modules it needs alone.
HOLDER = f"""import sys, time, types
package = types.ModuleType("neobert")
package.__path__ = [{str(REPO / "neobert")!r}]
sys.modules["neobert"] = package
from neobert.outputs import hold_output_dir
with hold_output_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""
# Set by a launcher for the ranks it starts; the holder and the command lines here are rank 0 of their own run.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "SLURM_NTASKS", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
STARTED = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


def environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return env | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture
def holder(tmp_path):
    """Starts a process holding a directory; yields a function (directory) -> the process, once it holds."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    started = []

    def hold(directory: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(script), str(directory)], cwd=REPO, env=environment(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(proc)
        assert proc.stdout.readline() == "held\n", proc.communicate()[0]
        return proc

    yield hold
    for proc in started:
        proc.kill()
        proc.wait()


def refusal(directory: Path, proc: subprocess.Popen, script: Path, where: str | None = None,
            noun: str = "output_dir") -> str:
    """The exact refusal of a directory `proc` (running `script`) holds, started at any time (a pattern)."""
    where = where or f"output_dir='{directory}'"
    command = f"{Path(sys.executable).name} {script} {directory}"
    return (re.escape(f"{where} is in use by another run (pid {proc.pid} on {socket.gethostname()}, started ")
            + STARTED + re.escape(f" by `{command}`): one run writes a directory at a time; wait for that run to "
                                  f"end (or stop it), or choose another {noun}"))


def interrupted_write(run: Path) -> Path:
    """A live run's checkpoint being written (AtomicCheckpointIO's temporary file), beside its checkpoints."""
    partial = checkpoint_dir(run) / ".step-00000002.ckpt.k3x9q1.tmp"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"half a checkpoint")
    return partial


def test_a_second_pretraining_run_is_refused_naming_the_holder_and_touches_nothing(tmp_path, holder):
    config = tiny_config(tmp_path)
    run = Path(config.output_dir)
    partial = interrupted_write(run)
    proc = holder(run)
    second = subprocess.run([sys.executable, "-m", "experiments.pretrain", f"data.source={config.data.source}",
                             "model.preset=tiny", "data.max_length=32", "trainer.accelerator=cpu",
                             f"output_dir={run}", "resume=true"],
                            cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=300)
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert re.fullmatch("error: " + refusal(run, proc, tmp_path / "holder.py"), errors[0]), errors[0]
    # It used to remove the live run's temporary file ("the temporary file of a checkpoint write that was
    # interrupted") and train beside it
    assert partial.read_bytes() == b"half a checkpoint"
    assert sorted(p.name for p in run.rglob("*")) == sorted([RUN_LOCK, "checkpoints", partial.name])


def test_the_clean_up_of_interrupted_writes_never_touches_a_live_runs_files(tmp_path, holder):
    run = tmp_path / "run"
    partial = interrupted_write(run)
    proc = holder(run)
    with pytest.raises(ConfigError, match=refusal(run, proc, tmp_path / "holder.py")):
        resume_checkpoint(run)
    assert partial.is_file()
    proc.kill()
    proc.wait()
    assert resume_checkpoint(run) is None and not partial.exists()  # its holder gone, it is a leftover


def test_a_killed_holder_blocks_no_one(tmp_path, holder):
    run = tmp_path / "run"
    proc = holder(run)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run / RUN_LOCK).is_file()  # what a kill -9 leaves
    with hold_output_dir(run) as writer:
        assert writer and f'"pid": {os.getpid()}' in (run / RUN_LOCK).read_text()
    assert not (run / RUN_LOCK).exists()


def test_the_other_ranks_of_a_run_neither_hold_nor_refuse(tmp_path, holder, monkeypatch):
    """Lightning's launcher starts rank 1 with LOCAL_RANK=1 while rank 0 holds the directory."""
    run, task_dir = tmp_path / "run", tmp_path / "out" / "rte"
    partial = interrupted_write(run)
    holder(run)
    holder(task_dir)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with hold_output_dir(run) as writer:
        assert not writer
    assert resume_checkpoint(run) is None and partial.is_file()  # rank 0 cleans up, once
    # a GLUE run's rank 1 checks its task directory as rank 0 did
    assert claim_output_dir(task_dir, FINETUNE_TASK, where="task", noun="output_dir", overwrite=True) == []


@pytest.mark.parametrize("environ, zero", [
    ({}, True), ({"LOCAL_RANK": "1"}, False), ({"LOCAL_RANK": "0", "NODE_RANK": "0"}, True),
    ({"NODE_RANK": "1"}, False), ({"LOCAL_RANK": "0", "GROUP_RANK": "1"}, False),
    ({"RANK": "3", "LOCAL_RANK": "0"}, False), ({"RANK": "0", "GROUP_RANK": "1", "SLURM_PROCID": "1"}, True),
    ({"SLURM_PROCID": "2"}, False), ({"SLURM_PROCID": "0"}, True), ({"JSM_NAMESPACE_RANK": "5"}, False),
])
def test_rank_zero_of_a_run_as_each_launcher_says(environ, zero):
    """torchrun's RANK is the global rank itself; Lightning's launcher sets LOCAL_RANK (and NODE_RANK or GROUP_RANK
    on the other nodes); srun and jsrun their own."""
    assert is_global_rank_zero(environ) is zero


def test_a_process_holds_again_what_it_holds_and_a_folder_inside_is_another_directory(tmp_path, holder):
    run = tmp_path / "runs" / "x"
    with hold_output_dir(run), hold_output_dir(run) as again, hold_output_dir(run / "recipe") as nested:
        assert again and nested and (run / RUN_LOCK).is_file() and (run / "recipe" / RUN_LOCK).is_file()
    assert not (tmp_path / "runs").exists()  # the folders the hold made, still empty, go with it
    proc = holder(run)
    with hold_output_dir(run / "recipe"):  # a nested run under a held directory (the GPU check, the ablations)
        pass
    with pytest.raises(ConfigError, match=refusal(run, proc, tmp_path / "holder.py")):
        run_pretraining(tiny_config(tmp_path, f"output_dir={run}"))


def test_an_output_never_goes_into_a_held_directory_and_a_lock_file_is_no_ones(tmp_path, holder):
    out = tmp_path / "out"
    proc = holder(out)
    with pytest.raises(ConfigError, match=refusal(out, proc, tmp_path / "holder.py", f"export directory {out}",
                                                  "export directory")):
        claim_output_dir(out, EXPORT, where=f"export directory {out}", noun="export directory", overwrite=True)
    proc.kill()
    proc.wait()
    (out / "config.json").write_text("{}")  # an export beside the lock file a killed run left
    assert claim_output_dir(out, EXPORT, where="out", noun="directory", overwrite=True) == [out / "config.json"]
    assert clear_output_dir(out, EXPORT) == [out / "config.json"] and (out / RUN_LOCK).is_file()


def test_glue_and_contrastive_refuse_a_held_directory(tmp_path, holder):
    data = tmp_path / "glue"
    write_parquet_task(data, "rte")
    task_dir = tmp_path / "out" / "rte"
    proc = holder(task_dir)
    where = f"invalid config key 'output_dir': the task directory {task_dir}"
    with pytest.raises(ConfigError, match=refusal(task_dir, proc, tmp_path / "holder.py", where)):
        run_glue("rte", model="preset:tiny", overrides=[f"data.path={data}", f"output_dir={tmp_path / 'out'}",
                                                        "transfer_from=null", "overwrite=true"])
    assert sorted(p.name for p in task_dir.iterdir()) == [RUN_LOCK]
    run = tmp_path / "contrastive"
    proc = holder(run)
    with pytest.raises(ConfigError, match=refusal(run, proc, tmp_path / "holder.py")):
        run_contrastive(load_config(ContrastiveConfig, None, [f"output_dir={run}", "resume=true"]))


def test_a_phased_run_holds_its_directory_through_every_phase(tmp_path):
    config = tiny_config(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=1",
                         "phases=[{name: a, steps: 1}, {name: b}]")
    exports = run_phases(config)
    assert [path.name for path in exports] == ["a", "b"] and all((path / "model.safetensors").is_file()
                                                                 for path in exports)
    assert not (Path(config.output_dir) / RUN_LOCK).exists()
