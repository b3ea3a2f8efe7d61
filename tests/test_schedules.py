"""Schedules beyond the paper's recipe: warmup-stable-decay learning rates and decay branches, the batch-size
warm-up, the masking-rate schedule and the EMA of the weights; their values at the boundaries and exact resume
in the middle of each."""

import itertools
import math

import pytest
import torch
from safetensors.torch import load_file

from neobert.config import ConfigError, SchedulerConfig, load_config
from neobert.errors import CheckpointError
from neobert.config.pretrain import MaskingConfig, PretrainConfig
from neobert.data.pretraining import PretrainingStream
from neobert.data.schedules import DataSchedule, piecewise_linear
from neobert.data.stream_state import DATA_STATE_KEY, batch_stream_state
from neobert.jobs.pretrain import prepare, run_pretraining
from neobert.lit.optim import lr_factor
from tests.test_pretrain import Recorder, tiny_config


# ---------------------------------------------------------------------------------------------- wsd
@pytest.mark.parametrize("shape,halfway", [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_values_at_the_boundaries(shape, halfway):
    config = SchedulerConfig(name="wsd", warmup_steps=10, decay_steps=20, decay_shape=shape, final_ratio=0.1)
    factor = lr_factor(config, total_steps=100)
    assert factor(0) == 0 and factor(5) == pytest.approx(0.5)  # first step, mid-warm-up
    assert factor(10) == 1 and factor(79) == 1  # end of warm-up, last stable step
    assert factor(80) == 1  # start of the decay (progress 0)
    assert factor(90) == pytest.approx(0.1 + 0.9 * halfway)
    assert factor(99) < factor(98) < factor(90) and factor(99) > 0.1  # last trained step, still decaying
    assert factor(100) == pytest.approx(0.1) and factor(10_000) == pytest.approx(0.1)  # after the end


def test_wsd_decay_length_phases_and_their_config_errors():
    full = lr_factor(SchedulerConfig(name="wsd", warmup_steps=0, decay_phase_fraction=0.25, final_ratio=0), 100)
    assert full(74) == 1 and full(75) == 1 and full(76) < 1 and full(100) == 0  # the last quarter decays
    stable = lr_factor(SchedulerConfig(name="wsd", warmup_steps=10, phase="stable"), 100)
    assert stable(10) == stable(99) == stable(10**6) == 1  # no decay: the run can be extended
    branch = lr_factor(SchedulerConfig(name="wsd", warmup_steps=10, phase="decay", decay_shape="linear",
                                       final_ratio=0), 100, start_step=60)
    assert branch(60) == 1 and branch(80) == pytest.approx(0.5) and branch(100) == 0
    uninterrupted = lr_factor(SchedulerConfig(name="wsd", warmup_steps=10, decay_steps=40, decay_shape="linear",
                                              final_ratio=0), 100)
    assert [branch(s) for s in range(60, 101)] == [uninterrupted(s) for s in range(60, 101)]
    for overrides, key in ((["scheduler.phase=stable"], "scheduler.phase"),  # cosine has no stable phase
                           (["scheduler.name=wsd", "scheduler.decay_shape=exp"], "scheduler.decay_shape"),
                           (["scheduler.name=wsd", "scheduler.phase=decay", "scheduler.decay_steps=5"],
                            "scheduler.decay_steps"),
                           (["masking.rate_schedule=[[10,0.3],[5,0.2]]"], "masking.rate_schedule"),
                           (["trainer.batch_size_warmup.start_batch_size=4"], "trainer.batch_size_warmup"),
                           (["trainer.ema.decay=1.0"], "trainer.ema.decay"),
                           (["trainer.ema.decay=0.9", "trainer.strategy=fsdp2"], "trainer.ema")):
        with pytest.raises(ConfigError, match=key):
            load_config(PretrainConfig, None, overrides)
    from neobert.config.glue import GlueConfig

    with pytest.raises(ConfigError, match="trainer.ema"):  # only pretraining exports an EMA so far
        load_config(GlueConfig, "glue/rte", ["trainer.ema.decay=0.9"])


# ---------------------------------------------------------------------------------------------- data schedules
def test_piecewise_linear_masking_rate_with_a_jump():
    points = [[0, 0.3], [100, 0.15], [100, 0.05]]
    assert [piecewise_linear(points, s, 0.2) for s in (0, 50, 99, 100, 10**6)] == pytest.approx(
        [0.3, 0.225, 0.1515, 0.05, 0.05])
    assert piecewise_linear([], 7, 0.2) == 0.2
    assert piecewise_linear([[10, 0.4], [20, 0.2]], 0, 0.2) == 0.4  # constant before the first point


def test_batch_size_warmup_ramps_by_tokens_to_the_full_batch():
    # Full batch 16 x 2 accumulation x 2 devices = 64 sequences of 100 tokens; from 8 sequences over 20,000 tokens.
    schedule = DataSchedule(16, accumulate=2, world_size=2, start_batch_size=8, warmup_tokens=20_000,
                            sequence_length=100)
    sizes = [schedule.batch_size(step) for step in range(12)]
    assert sizes[0] == 2  # 8 sequences / (2 x 2)
    assert sizes == sorted(sizes) and sizes[-1] == 16 and schedule.batch_size(10**5) == 16
    tokens = itertools.accumulate(size * 4 * 100 for size in sizes)
    full_from = next(step for step, size in enumerate(sizes) if size == 16)
    assert list(tokens)[full_from - 1] >= 20_000 * (1 - 4 / 64)  # full once (nearly) all the ramp's tokens are in
    # the run's micro-batches, all ranks together: 2 accumulation x 2 devices = 4 per optimizer step
    assert schedule.step_of(0) == schedule.step_of(3) == 0 and schedule.step_of(4) == 1
    assert DataSchedule(16).batch_size(0) == 16  # no warm-up


@pytest.fixture(scope="module")
def tokenizer():
    from neobert.data.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.test_pretrain import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl", n=300)


def _stream(corpus, tokenizer, schedule, start_states=None, rotation=0, **data):
    from tests.test_data_pretraining import _data

    return PretrainingStream(_data(corpus, **data), MaskingConfig(rate=0.2), tokenizer, 8, schedule=schedule,
                             start_states=start_states, rotation=rotation)


def _take(stream, n):
    return list(itertools.islice(iter(stream), n))


@pytest.mark.parametrize("packing", ["none", "greedy", "best_fit"])
def test_the_stream_follows_the_schedules_and_resumes_mid_ramp(corpus, tokenizer, packing):
    def schedule():
        return DataSchedule(8, accumulate=2, start_batch_size=2, warmup_tokens=2_000, sequence_length=64,
                            mask_rate_schedule=[[0, 0.4], [6, 0.1]])

    straight = _take(_stream(corpus, tokenizer, schedule(), packing=packing), 30)
    stats = [batch[DATA_STATE_KEY]["stats"] for batch in straight]
    expected = schedule()
    for index, (batch, stat) in enumerate(zip(straight, stats)):
        step = index // 2  # two micro-batches per optimizer step
        # rows of a packed batch; a best-fit batch's are stat["rows"]; an unpadded batch's documents are its rows
        rows = {"none": len(batch.get("cu_seqlens", [])) - 1, "greedy": batch["input_ids"].shape[0],
                "best_fit": stat["rows"]}[packing]
        assert rows == stat["rows"] == expected.batch_size(step)
        assert stat["mask_rate"] == pytest.approx(expected.mask_rate(step))
    assert stats[0]["rows"] == 1 and stats[-1]["rows"] == 8  # ramped from 2 sequences to the full 16
    # The masking rate follows the schedule: 40% of the maskable tokens early, 10% from step 6.
    early = sum(int((b["labels"] != -100).sum()) for b in straight[:4]) / sum(s["tokens"] for s in stats[:4])
    late = sum(int((b["labels"] != -100).sum()) for b in straight[14:]) / sum(s["tokens"] for s in stats[14:])
    assert 0.25 < early < 0.45 and 0.04 < late < 0.14
    for k in (2, 5, 11):  # mid-ramp and mid-masking-ramp
        resumed = _take(_stream(corpus, tokenizer, schedule(), packing=packing,
                                start_states={0: batch_stream_state(straight[k])}), 6)
        for a, b in zip(straight[k + 1:], resumed):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_two_workers_take_turns_in_the_ramp(corpus, tokenizer):
    # Worker streams are read in turn; each knows its micro-batches' steps from its own batch count alone.
    def schedule():
        return DataSchedule(8, accumulate=3, start_batch_size=3, warmup_tokens=3_000, sequence_length=64)

    streams = [iter(_stream(corpus, tokenizer, schedule(), rotation=r, num_workers=2)) for r in (0, 1)]
    turns = [next(streams[index % 2]) for index in range(24)]  # what the DataLoader yields, in order
    expected = schedule()
    assert [b[DATA_STATE_KEY]["stats"]["rows"] for b in turns] == [expected.batch_size(i // 3) for i in range(24)]
    assert len({b[DATA_STATE_KEY]["stats"]["rows"] for b in turns}) > 2  # the ramp is crossed


# ---------------------------------------------------------------------------------------------- whole runs
class LrRecorder(Recorder):
    def __init__(self, stop_at_step=None):
        super().__init__(stop_at_step)
        self.lrs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        super().on_train_batch_start(trainer, module, batch, batch_idx)
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


EVERYTHING = ["scheduler.name=wsd", "scheduler.warmup_steps=3", "scheduler.decay_steps=3",
              "scheduler.decay_shape=1-sqrt", "scheduler.final_ratio=0", "trainer.max_steps=8",
              "trainer.accumulate_grad_batches=2", "trainer.checkpoint_every_n_steps=1", "trainer.keep_checkpoints=-1",
              "trainer.batch_size_warmup.start_batch_size=2", "trainer.batch_size_warmup.tokens=600",
              "masking.rate_schedule=[[0,0.4],[6,0.15]]", "trainer.ema.decay=0.5", "trainer.ema.every_n_steps=2",
              "data.num_workers=2", "data.shuffle_buffer=16", "data.validation_docs=8",
              "trainer.eval_every_n_steps=4"]


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", [2, 6], ids=["mid-warmup-and-ramp", "mid-decay"])
def test_resume_mid_schedule_equals_an_uninterrupted_run(tmp_path, crash_at):
    straight = LrRecorder()
    run_pretraining(tiny_config(tmp_path / "a", *EVERYTHING), [straight])
    first = LrRecorder(stop_at_step=crash_at)
    with pytest.raises(InterruptedError):
        run_pretraining(tiny_config(tmp_path / "b", *EVERYTHING), [first])
    second = LrRecorder()
    run_pretraining(tiny_config(tmp_path / "b", *EVERYTHING, "resume=true"), [second])

    assert len(first.batches + second.batches) == len(straight.batches) == 16
    for (ids_a, labels_a), (ids_b, labels_b) in zip(straight.batches, first.batches + second.batches):
        assert torch.equal(ids_a, ids_b) and torch.equal(labels_a, labels_b)
    assert first.losses + second.losses == pytest.approx(straight.losses, abs=1e-6)
    assert first.lrs + second.lrs == pytest.approx(straight.lrs, abs=1e-12)
    sizes = straight.sequences
    assert sizes[0] < sizes[-1] == 4  # the batch ramped up to the full micro-batch
    assert straight.lrs[0] == 0 and straight.lrs[-1] < straight.lrs[8] == pytest.approx(6e-4)
    for weights in ("model.safetensors", "ema/model.safetensors"):  # the EMA too resumes exactly
        a, b = (load_file(tmp_path / run / "run" / "export" / weights) for run in ("a", "b"))
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
    raw, ema = (load_file(tmp_path / "a" / "run" / "export" / w) for w in ("model.safetensors", "ema/model.safetensors"))
    assert any(not torch.allclose(raw[k], ema[k]) for k in raw)


@pytest.mark.slow
def test_a_decay_branch_from_a_stable_checkpoint_equals_the_full_run(tmp_path):
    common = ["scheduler.name=wsd", "scheduler.warmup_steps=2", "scheduler.decay_shape=linear",
              "scheduler.final_ratio=0", "trainer.checkpoint_every_n_steps=1", "trainer.keep_checkpoints=-1",
              "data.num_workers=2"]
    full = LrRecorder()
    run_pretraining(tiny_config(tmp_path / "full", *common, "trainer.max_steps=8", "scheduler.decay_steps=3"), [full])
    stable = LrRecorder()
    run_pretraining(tiny_config(tmp_path / "stable", *common, "trainer.max_steps=7", "scheduler.phase=stable"),
                    [stable])
    stable_checkpoint = tmp_path / "stable" / "run" / "checkpoints" / "step-00000005.ckpt"
    branch = LrRecorder()
    run_pretraining(tiny_config(tmp_path / "branch", *common, "trainer.max_steps=8", "scheduler.phase=decay",
                                f"branch_from={stable_checkpoint}"), [branch])
    assert stable.lrs[:5] == pytest.approx(full.lrs[:5], abs=1e-12) and stable.lrs[6] == pytest.approx(6e-4)
    assert branch.lrs == pytest.approx(full.lrs[5:], abs=1e-12) and branch.lrs[-1] < branch.lrs[0]
    assert branch.losses == pytest.approx(full.losses[5:], abs=1e-6)
    for (ids_a, labels_a), (ids_b, labels_b) in zip(full.batches[5:], branch.batches):
        assert torch.equal(ids_a, ids_b) and torch.equal(labels_a, labels_b)
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        prepare(tiny_config(tmp_path / "late", *common, "trainer.max_steps=5", f"branch_from={stable_checkpoint}"))


def test_ema_updates_every_n_steps_and_round_trips_through_a_checkpoint():
    import lightning as L
    from types import SimpleNamespace

    from neobert.lit.checkpoints import EMA_STATE_KEY
    from neobert.lit.ema import ExponentialMovingAverage

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    module, ema = Tiny(), ExponentialMovingAverage(decay=0.75, every_n_steps=2)
    trainer = SimpleNamespace(strategy=None)  # no DeepSpeed: the module's own weights are the masters
    start = module.layer.weight.detach().clone()
    ema.on_train_start(trainer, module)
    with torch.no_grad():
        module.layer.weight.add_(1.0)
    for step in (1, 1, 3):  # not a multiple of every_n_steps: no update
        ema.on_train_batch_end(SimpleNamespace(global_step=step, strategy=None), module, None, None, 0)
    torch.testing.assert_close(ema.weights["layer.weight"], start)
    ema.on_train_batch_end(SimpleNamespace(global_step=2, strategy=None), module, None, None, 0)
    ema.on_train_batch_end(SimpleNamespace(global_step=2, strategy=None), module, None, None, 1)  # same step, 2nd micro-batch
    torch.testing.assert_close(ema.weights["layer.weight"], 0.75 * start + 0.25 * (start + 1))
    raw = module.layer.weight.detach().clone()
    with ema.swapped_in(module):  # how val/loss_ema is computed
        torch.testing.assert_close(module.layer.weight.detach(), ema.weights["layer.weight"])
    torch.testing.assert_close(module.layer.weight.detach(), raw)
    checkpoint = {}
    ema.on_save_checkpoint(None, module, checkpoint)
    assert set(checkpoint[EMA_STATE_KEY]) == set(module.state_dict())  # the checkpoint's state_dict names
    restored = ExponentialMovingAverage(decay=0.75, every_n_steps=2)
    restored.load_state_dict(ema.state_dict())
    restored.on_load_checkpoint(None, module, checkpoint)
    restored.on_train_start(trainer, module)  # keeps the restored average
    torch.testing.assert_close(restored.weights["layer.weight"], ema.weights["layer.weight"])
    assert restored.last_update_step == 2


def test_branch_from_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'branch_from'.*does not exist"):
        prepare(tiny_config(tmp_path, f"branch_from={tmp_path / 'nope.ckpt'}"))
    (tmp_path / "bad.ckpt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="branch_from: .*bad.ckpt is not a readable checkpoint"):
        prepare(tiny_config(tmp_path, f"branch_from={tmp_path / 'bad.ckpt'}"))
    with pytest.raises(ConfigError, match="branch_from"):
        prepare(tiny_config(tmp_path, f"branch_from={tmp_path / 'bad.ckpt'}", f"init_from={tmp_path}"))
    with pytest.warns(FutureWarning, match="data.packing=greedy"):
        assert tiny_config(tmp_path, "data.packing=true").data.packing == "greedy"
    with pytest.warns(FutureWarning, match="data.packing=none"):
        assert tiny_config(tmp_path, "data.packing=false").data.packing == "none"
