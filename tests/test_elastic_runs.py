"""Real runs on another layout after a checkpoint, through the command line: one process with 2 micro-batches
per step resumed as 2 DDP processes (gloo) with 1 and more workers, and two "nodes" on this machine (one process
each, MASTER_ADDR=127.0.0.1) resumed on one node with twice the accumulation. Each run draws from a mixture of two
sources, and after the resume its per-step losses equal an uninterrupted run's (float reduction order apart)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neobert.config import to_yaml
from neobert.data.demo_corpus import demo_documents

from test_pretrain import tiny_config
from test_pretrain_slow import LAUNCHER_VARIABLES, REPO, train_losses

STEPS = 8  # checkpoints at 4 and 8; 16 sequences of 32 tokens per optimizer step, in data.streams=4; the first
# part of a resumed run stops at 4 with trainer.max_steps=4 (a stable wsd phase: an lr that does not depend on it)


def write_run(tmp_path: Path, *overrides: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    sources = []
    for name, docs in (("web", demo_documents()[:80]), ("code", demo_documents()[80:160])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        sources.append(f"{{name: {name}, source: '{path}', weight: 1}}")
    config = tiny_config(tmp_path, "data.source=null", f"data.sources=[{', '.join(sources)}]", "data.streams=4",
                         "trainer.micro_batch_size=8", f"trainer.max_steps={STEPS}",
                         "trainer.checkpoint_every_n_steps=4", "trainer.keep_checkpoints=-1",
                         "scheduler.name=wsd", "scheduler.phase=stable", *overrides)  # the lr whatever max_steps
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(config))
    return path


def launch(config: Path, *overrides: str, **environment: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **environment)
    return subprocess.Popen([sys.executable, "-m", "experiments.pretrain", "--config", str(config), *overrides],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(*processes: subprocess.Popen) -> None:
    for process in processes:
        try:
            out, _ = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the process and the ranks it started
            out, _ = process.communicate()
        assert process.returncode == 0, out[-4000:]


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def uninterrupted(tmp_path: Path) -> dict[int, float]:
    finish(launch(write_run(tmp_path), "trainer.accumulate_grad_batches=2"))
    losses = train_losses(tmp_path / "run", 0)
    assert sorted(losses) == list(range(STEPS))
    return losses


def assert_resumed_like(run: Path, uninterrupted: dict[int, float]) -> None:
    before, after = train_losses(run, 0), train_losses(run, 1)
    assert sorted(before) == list(range(4)) and sorted(after) == list(range(4, STEPS))
    assert {**before, **after} == pytest.approx(uninterrupted, abs=1e-5)
    data = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["PretrainingDataModule"]
    assert data["num_streams"] == 4 and data["batches_per_step"] == 2 and sum(data["trained_batches"]) == 2 * STEPS


@pytest.mark.slow
def test_runs_resumed_on_other_layouts_continue_the_uninterrupted_run(tmp_path):
    # One test, so that the uninterrupted run is made once whatever worker runs it.
    reference = uninterrupted(tmp_path / "uninterrupted")
    # one process with 2 micro-batches per step and a worker, resumed as 2 DDP processes with 2 workers each
    config = write_run(tmp_path / "ddp", "data.num_workers=1")
    finish(launch(config, "trainer.accumulate_grad_batches=2", "trainer.max_steps=4"))
    finish(launch(config, "resume=true", "trainer.strategy=ddp", "trainer.devices=2", "data.num_workers=2"))
    assert_resumed_like(tmp_path / "ddp" / "run", reference)
    # two nodes of one process each, resumed on one node with twice the accumulation
    config = write_run(tmp_path / "nodes")
    nodes, port = ("trainer.strategy=ddp", "trainer.num_nodes=2", "trainer.max_steps=4"), free_port()
    finish(*[launch(config, *nodes, NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
             for node in (0, 1)])
    finish(launch(config, "resume=true", "trainer.accumulate_grad_batches=2"))
    assert_resumed_like(tmp_path / "nodes" / "run", reference)


@pytest.mark.slow
def test_a_resume_the_data_cannot_follow_is_refused_before_anything_is_written(tmp_path):
    config = write_run(tmp_path, "trainer.max_steps=4")
    finish(launch(config))
    run = tmp_path / "run"
    listing = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    refused = launch(config, "resume=true", "trainer.max_steps=8", "trainer.accumulate_grad_batches=3")
    out, _ = refused.communicate(timeout=600)
    assert refused.returncode == 2, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        "error: resume: the checkpoint's optimizer steps take 1 micro-batches (trainer."
        "accumulate_grad_batches x devices x num_nodes), this run's 3: the global batch would change mid-run; set "
        "trainer.accumulate_grad_batches=1 on these 1 device(s) (a new global batch starts a new phase)")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == listing
