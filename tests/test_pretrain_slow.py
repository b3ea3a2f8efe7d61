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


def cli(*args, **popen):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "experiments.pretrain", *args], cwd=REPO, env=env,
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
def test_demo_end_to_end_beats_the_unigram_baseline(tmp_path):
    import neobert  # noqa: F401
    from transformers import AutoModelForMaskedLM

    from experiments.pretrain import main
    from neobert.data.corpus import unigram_entropy
    from neobert.data.tokenizer import load_tokenizer
    from neobert.jobs.pretrain import load_pretrain_config

    # The demo itself, for 150 of its 250 steps.
    overrides = [f"output_dir={tmp_path / 'demo'}", f"data.source={tmp_path / 'demo' / 'corpus.jsonl'}",
                 "trainer.max_steps=150", "logging.progress_bar=false", "trainer.eval_every_n_steps=75"]
    export_dir = main(overrides)
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


@pytest.mark.slow
def test_kill_minus_9_then_resume_continues_from_the_last_checkpoint(tmp_path):
    config = write_yaml(tmp_path, "trainer.max_steps=24", "trainer.checkpoint_every_n_steps=4",
                        "trainer.keep_checkpoints=-1", "trainer.micro_batch_size=8")
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

    proc = cli("--config", str(config), "resume=true")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 24
    for name, digest in before.items():  # what was written before the kill is intact
        if name != "last.ckpt":
            assert sha(checkpoints / name) == digest
            torch.load(checkpoints / name, weights_only=False)
    assert (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").read_bytes() == metrics_before
    resumed = read_curves([tmp_path / "run" / "logs" / "version_1" / "metrics.csv"], ["train/loss"])["train/loss"]
    assert min(resumed) >= killed_at and max(resumed) == 23  # continued from the checkpoint, not from step 0
