"""Phased recipes (`phases:`): every phase override takes effect at exactly its first step (lr, length, masking
rate, RoPE base), the lr schedule is one over the whole recipe, a run resumes exactly mid-phase, at a boundary and
after a crash during a boundary's export, `--phase` reruns from a phase's start, and every bad phase is an error
naming its key."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from test_pretrain import Recorder, tiny_config

from neobert.config import ConfigError
from neobert.jobs import pretrain as pretrain_job
from neobert.jobs.phases import PHASE_DONE, phase_config, plan_phases, run_phases
from neobert.jobs.pretrain import run_pretraining

PHASES = ("phases=[{name: a, steps: 3}, {name: b, steps: 2, overrides: {data.max_length: 48, "
          "model.overrides.rope_theta: 160000, masking.rate: 0.3, optimizer.lr: 3.0e-4}}, "
          "{name: c, overrides: {scheduler.phase: decay}}]")
RECIPE = [PHASES, "scheduler.name=wsd", "scheduler.phase=stable", "scheduler.warmup_steps=2", "trainer.max_steps=8",
          "data.num_workers=2", "trainer.accumulate_grad_batches=2", "trainer.checkpoint_every_n_steps=2",
          "scheduler.final_ratio=0"]


class PhaseRecorder(Recorder):
    """Per micro-batch: step, lr, longest document, masking rate, RoPE base."""

    def __init__(self, stop_at_step=None):
        super().__init__(stop_at_step)
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        super().on_train_batch_start(trainer, module, batch, batch_idx)
        stats = batch["data_state"]["stats"]
        self.seen.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"], int(batch["max_seqlen"]),
                          stats["mask_rate"], module.model.config.rope_theta))


def test_the_phases_resolve_and_are_placed_on_the_step_axis(tmp_path):
    runs = plan_phases(tiny_config(tmp_path, *RECIPE))
    assert [(r.name, r.start_step, r.end_step) for r in runs] == [("a", 0, 3), ("b", 3, 5), ("c", 5, 8)]
    a, b, c = (r.config for r in runs)
    assert (a.data.max_length, b.data.max_length, c.data.max_length) == (32, 48, 48)  # c keeps b's changes
    assert "rope_theta" not in a.model.overrides and b.model.overrides["rope_theta"] == c.model.overrides[
        "rope_theta"] == 160000
    assert (a.scheduler.phase, b.scheduler.phase, c.scheduler.phase) == ("stable", "stable", "decay")
    assert [r.config.export_dir for r in runs] == [str(tmp_path / "run" / "export" / n) for n in "abc"]
    assert runs[1].start_checkpoint == runs[0].final_checkpoint and runs[0].start_checkpoint is None
    # by tokens: 2 sequences x 2 accumulation x 48 tokens per step in phase b
    by_tokens = plan_phases(tiny_config(tmp_path, *RECIPE, PHASES.replace("steps: 2,", "tokens: 900,")))
    assert by_tokens[1].end_step - by_tokens[1].start_step == math.ceil(900 / (4 * 2 * 48))


def test_every_override_takes_effect_at_its_first_step(tmp_path):
    recorder = PhaseRecorder()
    exports = run_phases(tiny_config(tmp_path, *RECIPE), extra_callbacks=[recorder])
    assert [p.name for p in exports] == ["a", "b", "c"]
    for export in exports:
        assert json.loads((export / PHASE_DONE).read_text())["phase"] == export.name
        assert (export / "model.safetensors").is_file()
    by_step = {}
    for step, lr, longest, rate, theta in recorder.seen:
        by_step.setdefault(step, []).append((lr, longest, rate, theta))
    assert sorted(by_step) == list(range(8))
    for step, micro in by_step.items():
        phase = "a" if step < 3 else "b" if step < 5 else "c"
        for lr, longest, rate, theta in micro:
            assert longest <= (32 if phase == "a" else 48)
            assert rate == pytest.approx(0.2 if phase == "a" else 0.3)
            assert theta == (10000.0 if phase == "a" else 160000)
    assert max(longest for step in (3, 4, 5, 6, 7) for _, longest, _, _ in by_step[step]) > 32
    lrs = [by_step[step][0][0] for step in range(8)]
    assert lrs[:3] == pytest.approx([0, 6e-4 / 2, 6e-4])  # warm-up over 2 steps, then the stable peak
    assert lrs[3:5] == pytest.approx([3e-4, 3e-4])  # b's peak, no second warm-up
    assert lrs[5] == pytest.approx(3e-4) and lrs[5] > lrs[6] > lrs[7] > 0  # c decays from its first step


def _crash_in_export_of(monkeypatch, name):
    original = pretrain_job.export_module
    calls = {"n": 0}

    def export(module, export_dir, is_global_zero):
        if export_dir.name == name and not calls["n"]:
            calls["n"] += 1
            (export_dir / "config.json").parent.mkdir(parents=True, exist_ok=True)
            (export_dir / "config.json").write_text("{")  # half written
            raise InterruptedError("crash during the export")
        return original(module, export_dir, is_global_zero)

    monkeypatch.setattr(pretrain_job, "export_module", export)


@pytest.mark.slow
@pytest.mark.parametrize("crash", ["mid-phase", "at-boundary", "in-export"])
def test_a_phased_run_resumes_exactly(tmp_path, monkeypatch, crash):
    straight = PhaseRecorder()
    run_phases(tiny_config(tmp_path / "a", *RECIPE), extra_callbacks=[straight])
    first = PhaseRecorder(stop_at_step={"mid-phase": 4, "at-boundary": 3, "in-export": None}[crash])
    if crash == "in-export":
        _crash_in_export_of(monkeypatch, "a")
    with pytest.raises(InterruptedError):
        run_phases(tiny_config(tmp_path / "b", *RECIPE), extra_callbacks=[first])
    second = PhaseRecorder()
    run_phases(tiny_config(tmp_path / "b", *RECIPE, "resume=true"), extra_callbacks=[second])
    done = len(straight.batches) - len(second.batches)  # micro-batches before the resumed checkpoint
    assert done == {"mid-phase": 8, "at-boundary": 6, "in-export": 6}[crash]
    for (ids_a, labels_a), (ids_b, labels_b) in zip(straight.batches[done:], second.batches):
        assert torch.equal(ids_a, ids_b) and torch.equal(labels_a, labels_b)
    assert second.losses == pytest.approx(straight.losses[done:], abs=1e-6)
    assert len(second.seen) == len(straight.seen) - done
    for resumed, uninterrupted in zip(second.seen, straight.seen[done:]):  # step, lr, length, rate, RoPE base
        assert resumed == pytest.approx(uninterrupted, rel=1e-12)
    for name in "abc":
        exported = tmp_path / "b" / "run" / "export" / name
        assert (exported / PHASE_DONE).is_file() and json.loads((exported / "config.json").read_text())


def test_a_rerun_from_a_named_phase_branches_into_its_own_directory(tmp_path):
    config = tiny_config(tmp_path, *RECIPE)
    run_phases(config)
    branch = PhaseRecorder()
    exports = run_phases(tiny_config(tmp_path, *RECIPE, "optimizer.lr=1e-3"), "c", extra_callbacks=[branch])
    assert exports == [tmp_path / "run" / "from-c" / "export" / "c"]
    assert {step for step, *_ in branch.seen} == {5, 6, 7}  # only c, from the end of b
    assert (tmp_path / "run" / "export" / "c" / PHASE_DONE).is_file()  # the first run's c is untouched
    with pytest.raises(ConfigError, match=r"--phase 'd' is not a phase of this recipe: \['a', 'b', 'c'\]"):
        run_phases(config, "d")


@pytest.mark.parametrize("phases, key, message", [
    ("[{name: a, steps: 3}, {name: b, overrides: {model.overrides.hidden_size: 64}}]",
     "phases[1].overrides.model.overrides.hidden_size", "cannot change between phases"),
    ("[{name: a, steps: 3}, {name: b, overrides: {data.tokenizer: x}}]", "phases[1].overrides.data.tokenizer",
     "cannot change between phases"),
    ("[{name: a, steps: 6}, {name: b, steps: 5}]", "phases[1].steps", "end at step 11, beyond trainer.max_steps=8"),
    ("[{name: a}, {name: b, steps: 2}]", "phases[0].steps", "only the last phase may leave its length out"),
    ("[{name: a, steps: 3}, {name: a}]", "phases[1].name", "'a' names two phases"),
    ("[{name: a, steps: 3}, {name: b, overrides: {data.sources: [{name: x, source: /no/such.jsonl}], "
     "data.source: null}}]", "data.sources[0].source", "does not exist"),
    ("[{name: a, steps: 3}, {name: b, overrides: {masking.rate: 1.5}}]", "masking.rate", r"in phase 1, 'b'"),
    ("[{name: a, steps: 3}, {name: b, overrides: {data.max_lenght: 64}}]", "phases[1].overrides.data.max_lenght",
     "max_lenght"),
])
def test_bad_phases_name_the_key(tmp_path, phases, key, message):
    config = tiny_config(tmp_path, f"phases={phases}", "trainer.max_steps=8")
    with pytest.raises(ConfigError, match=rf"{re_key(key)}.*{message}"):
        for run in plan_phases(config):
            pretrain_job.prepare(run.config, run)


def re_key(key: str) -> str:
    import re

    return re.escape(key)


def test_a_phased_config_is_not_run_as_one_phase(tmp_path):
    with pytest.raises(ConfigError, match="invalid config key 'phases': a phased recipe runs phase by phase"):
        run_pretraining(tiny_config(tmp_path, *RECIPE))
    assert phase_config(tiny_config(tmp_path, *RECIPE), 2).phases == []


def test_the_neobert_recipe_phases_are_its_two_stage_configs_key_by_key():
    from omegaconf import OmegaConf

    from neobert.config import load_config
    from neobert.config.pretrain import PretrainConfig

    recipe = load_config(PretrainConfig, "recipes/neobert")
    runs = plan_phases(recipe)
    assert [(r.name, r.start_step, r.end_step) for r in runs] == [("stage1", 0, 1_000_000),
                                                                  ("stage2", 1_000_000, 1_050_000)]
    # what a phase sets for itself: its steps, where it writes, and (stage 2) that it continues stage 1's state
    own = {"trainer.max_steps", "output_dir", "export_dir", "init_from", "resume"}
    for run, name in zip(runs, ("neobert", "neobert-4096")):
        expected = flatten(OmegaConf.to_container(OmegaConf.structured(load_config(PretrainConfig, name))))
        resolved = flatten(OmegaConf.to_container(OmegaConf.structured(run.config)))
        assert expected.keys() == resolved.keys()
        differing = {key for key in expected if expected[key] != resolved[key]}
        assert differing <= own, {key: (expected[key], resolved[key]) for key in differing - own}
    assert runs[1].end_step - runs[1].start_step == load_config(PretrainConfig, "neobert-4096").trainer.max_steps
    # one cosine over stage 1 (its own 1,000,000 steps, as neobert.yaml), stage 2 constant at 6e-5
    assert (runs[0].schedule_start, runs[0].schedule_end) == (0, 1_000_000)
    assert (runs[1].schedule_start, runs[1].schedule_end) == (1_000_000, 1_050_000)


def flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}
