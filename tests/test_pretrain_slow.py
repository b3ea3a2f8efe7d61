"""End-to-end pretraining runs through the command line: 2-process DDP on CPU, the embedded demo at a reduced
size, and kill -9 followed by resume."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from neobert.config import to_yaml
from neobert.eval.plots import final_value, read_curves

from test_pretrain import tiny_config

REPO = Path(__file__).resolve().parents[1]


# Set by a launcher (Lightning, torchrun, SLURM) for the ranks it starts: inherited, they make Lightning skip
# starting rank 1 itself.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "SLURM_NTASKS", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def cli(*args, command=("-m", "experiments.pretrain"), **popen):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, *command, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def write_yaml(tmp_path, *overrides) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(tiny_config(tmp_path, *overrides)))
    return path


@pytest.mark.slow
def test_ddp_two_processes_on_cpu_write_a_checkpoint(tmp_path):
    config = write_yaml(tmp_path, "trainer.strategy=ddp", "trainer.devices=2", "trainer.max_steps=2")
    proc = cli("--config", str(config), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and the rank-1 process Lightning started
        out, _ = proc.communicate()
        pytest.fail(f"2-process DDP run did not finish in 600 s; its output:\n{out[-5000:]}")
    assert proc.returncode == 0, out[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2
    data_state = checkpoint["PretrainingDataModule"]
    assert data_state["num_streams"] == 2 and sorted(data_state["streams"]) == [0, 1]  # both ranks' positions
    assert data_state["trained_batches"] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # minutes on an idle 2-core machine; far more on shared cores
def test_demo_end_to_end_beats_the_unigram_baseline(tmp_path, monkeypatch):
    import neobert  # noqa: F401
    from transformers import AutoModelForMaskedLM

    from experiments.pretrain import main
    from neobert.data.corpus import unigram_entropy
    from neobert.data.tokenizer import load_tokenizer
    from neobert.jobs.pretrain import load_pretrain_config

    # The demo itself, for 150 of its 250 steps, run from tmp_path: it writes its corpus to its own data.source
    # (runs/demo/corpus.jsonl under the working directory).
    monkeypatch.chdir(tmp_path)
    overrides = [f"output_dir={tmp_path / 'demo'}", "trainer.max_steps=150", "logging.progress_bar=false",
                 "trainer.eval_every_n_steps=75"]
    export_dir = main(overrides)
    assert (tmp_path / "runs" / "demo" / "corpus.jsonl").is_file()
    config = load_pretrain_config(None, overrides)
    baseline = unigram_entropy(config.data, load_tokenizer())
    csvs = sorted((tmp_path / "demo" / "logs").glob("version_*/metrics.csv"))
    assert final_value(csvs, "train/loss", last_n=5) < baseline
    assert final_value(csvs, "val/loss") < baseline  # held-out documents too
    assert (tmp_path / "demo" / "loss.png").stat().st_size > 10_000
    model = AutoModelForMaskedLM.from_pretrained(str(export_dir))
    assert model.config.hidden_size == 128


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# 24 steps, a checkpoint every 4, all kept.
KILL_RUN = ("trainer.max_steps=24", "trainer.checkpoint_every_n_steps=4", "trainer.keep_checkpoints=-1",
            "trainer.micro_batch_size=8")


def train_losses(run: Path, version: int) -> dict[int, float]:
    return read_curves([run / "logs" / f"version_{version}" / "metrics.csv"], ["train/loss"])["train/loss"]


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> dict[int, float]:
    """The per-step losses of the same run, never interrupted, through the same command line."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    out, _ = cli("--config", str(write_yaml(tmp_path, *KILL_RUN))).communicate(timeout=600)
    losses = train_losses(tmp_path / "run", 0)
    assert sorted(losses) == list(range(24)), out[-3000:]
    return losses


def assert_continues_like_the_uninterrupted_run(run: Path, resumed_from: int, uninterrupted: dict[int, float]):
    resumed = train_losses(run, 1)
    assert sorted(resumed) == list(range(resumed_from, 24))  # lost at most the steps since that checkpoint
    assert resumed == pytest.approx({step: uninterrupted[step] for step in resumed}, abs=1e-5)


@pytest.mark.slow
def test_kill_minus_9_then_resume_continues_from_the_last_checkpoint(tmp_path, uninterrupted_losses):
    config = write_yaml(tmp_path, *KILL_RUN)
    checkpoints = tmp_path / "run" / "checkpoints"
    proc = cli("--config", str(config))
    deadline = time.time() + 600
    while len(list(checkpoints.glob("step-*.ckpt"))) < 2:
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p.name: sha(p) for p in checkpoints.glob("*.ckpt")}
    metrics_before = (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").read_bytes()
    killed_at = torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"]
    assert 4 <= killed_at < 24
    newest = max(int(p.name[5:13]) for p in checkpoints.glob("step-*.ckpt"))
    assert newest in (killed_at, killed_at + 4)  # +4: killed between writing step-N.ckpt and last.ckpt
    # What a non-atomic writer killed mid-write leaves: a truncated last.ckpt. The resume falls back.
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 3])

    proc = cli("--config", str(config), "resume=true")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert (f"WARNING neobert.lit.checkpoints: resume=true: resuming from {checkpoints / f'step-{newest:08d}.ckpt'}; "
            f"skipped last.ckpt (corrupt or truncated (") in out, out[-3000:]
    assert "renamed to last.ckpt.unreadable" in out
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 24
    for name, digest in before.items():  # what was written before the kill is intact
        if name != "last.ckpt":
            assert sha(checkpoints / name) == digest
            torch.load(checkpoints / name, weights_only=False)
    assert (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").read_bytes() == metrics_before
    assert_continues_like_the_uninterrupted_run(tmp_path / "run", newest, uninterrupted_losses)


# Runs the command line with os.replace held up when it is about to publish the second last.ckpt (step 8):
# the new checkpoint is then completely written under its temporary name, and not yet renamed. The test kills
# the process there. (A wrapper of the test's own: the package has no test-only code path.)
SLOW_RENAME = r"""
import os, sys, time
from pathlib import Path

marker, real_replace, calls = Path(sys.argv[1]), os.replace, []


def replace(src, dst, *args, **kwargs):
    if Path(dst).name == "last.ckpt":
        calls.append(dst)
        if len(calls) == 2:
            marker.write_text(str(src))
            time.sleep(600)
    return real_replace(src, dst, *args, **kwargs)


os.replace = replace
from experiments.pretrain import main

main(sys.argv[2:])
"""


@pytest.mark.slow
def test_kill_minus_9_during_a_checkpoint_write_then_resume(tmp_path, uninterrupted_losses):
    config = write_yaml(tmp_path, *KILL_RUN)
    checkpoints, marker = tmp_path / "run" / "checkpoints", tmp_path / "writing"
    proc = cli(str(marker), "--config", str(config), command=("-c", SLOW_RENAME))
    deadline = time.time() + 600
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.communicate()[0][-3000:]}"
        assert time.time() < deadline
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = Path(marker.read_text())
    assert partial.parent == checkpoints and partial.is_file()  # the interrupted write, beside the checkpoints
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 4  # the previous one, intact
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["last.ckpt", "step-00000004.ckpt",
                                                                   "step-00000008.ckpt"]

    proc = cli("--config", str(config), "resume=true")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert (f"WARNING neobert.lit.checkpoints: resume=true: resuming from {checkpoints / 'step-00000008.ckpt'}; "
            "skipped last.ckpt (older (step 4) than step-00000008.ckpt (step 8): the run stopped between writing "
            "the two)") in out, out[-3000:]
    assert f"removed {partial}, the temporary file of a checkpoint write that was interrupted" in out
    assert not partial.exists() and not list(checkpoints.glob(".*"))
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 24
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["last.ckpt"] + [
        f"step-{step:08d}.ckpt" for step in range(4, 25, 4)]  # no "-v1" copies
    assert_continues_like_the_uninterrupted_run(tmp_path / "run", 8, uninterrupted_losses)
