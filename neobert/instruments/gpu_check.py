"""The GPU-node check (`python -m experiments.gpu_check --config neobert`; docs/pretraining.md, "First GPU run"):
one command that proves a node runs a pretraining recipe, and how well. On the devices it finds (every CUDA GPU of
the node; a CPU runs it too, end to end, with a tiny recipe), in order:

1. ceilings, forward + backward at the recipe's micro-batch and length, in the loop's batch layout and arithmetic
   (DeepSpeed's half-precision weights without autocast, or float32 weights under autocast: Plan.ceiling_dtypes),
   tokens/s and MFU: the encoder alone, for reference (the throughput benchmark's training step,
   `neobert.instruments.timing`: its batch, its timed step, its FLOP count), then the model with its MLM head, the
   ceiling: the same tokens masked by the loop's masker, one step of MLMPretrainingModule's forward, its MLM loss
   and the backward (its FLOP count, train/mfu's); the report gives the head's share of the step (1 - encoder step
   / with-head step). With `profile=true`, `profile_steps` more steps of the ceiling under torch.profiler: a Chrome
   trace, and the self time of its CUDA kernels (its CPU operators on a CPU) by category
   (`neobert.instruments.kernel_profile`), as CSV and a section of the report;
2. loops: the recipe's real training loop (`run_pretraining`) for `steps` steps under its own strategy (e.g.
   deepspeed_stage_2) and under the plain one (Lightning's auto on one device, ddp on several); tokens/s and MFU are
   those MLMPretrainingModule logs (train/tokens_per_sec, train/mfu in the run's metrics CSV), averaged over the
   log intervals after `warmup_steps`; a validation and a checkpoint at the last step; loop/ceiling against the
   ceiling with the MLM head (what the loop runs, its FLOPs counted alike). With `profile=true` the recipe's loop is
   recorded over `profile_steps` steps after its warm-up (then untimed: `GpuCheckConfig.timed_from`), and the
   report sets its time by category beside the ceiling's, with the device's busy share of each;
3. resume: `resume_steps` more steps with resume=true from that checkpoint, which must start at step `steps`;
4. export: the end-of-run export, reloaded with NeoBERTForMaskedLM.from_pretrained and transformers'
   AutoModelForMaskedLM, one forward each (they must agree);
5. memory: each stage's peak device memory (n/a on a CPU) against the preflight's estimate for its strategy.

One Markdown table, printed and written to output_dir/gpu_check.md, and the same figures in gpu_check.json. A stage
that raises prints its traceback and is marked FAILED, and the others run where they can. `GpuCheckResult.failures`
names the failed stages and the ratios under their targets (`targets.*`, enforced on CUDA by default); the command
line exits 1 when there is any.

Several GPUs: the loops run in this process and Lightning starts the other ranks by running the same command again
(its script launcher); those ranks run the training stages only, and rank 0 measures and reports.

The stages themselves (what each runs and measures) are in `neobert.instruments.gpu_check_stages` and
`gpu_check_loops`; this module plans the check, runs the stages in order, judges the ratios against their targets and
writes the reports.
"""

from __future__ import annotations

import dataclasses
import json
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neobert.config import ConfigError
from neobert.config.gpu_check import GpuCheckConfig
from neobert.config.pretrain import CUDA_GRAPH_MODES, BatchSizeWarmupConfig, PretrainConfig, compile_warmup_steps
from neobert.instruments.gpu_check_loops import loop_profiler, loop_stage, resume_stage
from neobert.instruments.gpu_check_stages import (BELOW_TARGET, CEILING, ENCODER, EXPORT, FAILED, OK, PLAIN_LOOP,
                                                  PROFILE, RECIPE_LOOP, RESUME, SKIPPED, CEILING_PROFILE_FILES,
                                                  LOOP_PROFILE_FILES, Plan, ProfileFiles, StageRow, encoder_stage,
                                                  export_stage, head_ceiling_stage, log_interval, profile_stage)
from neobert.instruments.host_waits import host_wait_lines
from neobert.instruments.kernel_profile import (CATEGORIES, KernelProfile, cuda_graphs_or_error,
                                                trace_graphs_captured_from_now)
from neobert.jobs.pretrain import decide_compile, load_pretrain_config, prepare
from neobert.layout import GPU_CHECK_JSON, GPU_CHECK_MD, GPU_CHECK_PLAIN_RUN, GPU_CHECK_RECIPE_RUN, write_atomically
from neobert.lit.trainer import trains_on_gpu
from neobert.outputs import GPU_CHECK, claim_output_dir, clear_output_dir, is_global_rank_zero


@dataclass
class GpuCheckResult:
    device: str
    recipe: str
    rows: list[StageRow]
    failures: list[str]  # "stage: why", one per failed stage and per ratio under its target
    enforced: bool  # whether the ratio targets were enforced
    paths: dict[str, Path] = field(default_factory=dict)  # {"markdown", "json"}; empty on ranks other than 0
    head_share: float | None = None  # the MLM head's share of the ceiling's step (`mlm_head_share`)
    profile: KernelProfile | None = None  # with profile=true: the ceiling's step
    loop_profile: KernelProfile | None = None  # with profile=true: the recipe's loop, where it ran

    @property
    def passed(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------------------------------------- the run
def run_gpu_check(config: GpuCheckConfig) -> GpuCheckResult:
    """Runs every stage (see the module docstring), writes the reports and returns them with the failures."""
    config.validate()
    plan = make_plan(config)  # config errors end here, before any stage
    with cuda_graphs_or_error(plan.device, plan.recipe.model.compile_mode):  # "default" unless model.compile
        return _run_stages(config, plan)


def _run_stages(config: GpuCheckConfig, plan: Plan) -> GpuCheckResult:
    rank_zero = is_global_rank_zero()
    if rank_zero:
        clear_earlier_check(plan.output_dir, config.overwrite)
    rows, profiled = {}, None
    if config.profile and plan.recipe.model.compile and plan.recipe.model.compile_mode in CUDA_GRAPH_MODES:
        trace_graphs_captured_from_now(plan.device)  # before the encoder's and the ceiling's graphs are captured
    if rank_zero:
        rows[ENCODER] = encoder_stage(plan)
        rows[CEILING], step = head_ceiling_stage(plan)
        if config.profile:
            rows[PROFILE], profiled = profile_stage(plan, step)
        del step  # its model and gradients: not held through the loops
    else:
        rows[ENCODER], rows[CEILING] = StageRow(ENCODER, status=SKIPPED), StageRow(CEILING, status=SKIPPED)
    recipe_strategy = plan.recipe.trainer.strategy
    profiler = loop_profiler(plan) if rank_zero else None
    rows[RECIPE_LOOP], recipe_config = loop_stage(plan, RECIPE_LOOP, recipe_strategy, GPU_CHECK_RECIPE_RUN, profiler)
    if config.speed_only:
        for stage in (PLAIN_LOOP, RESUME, EXPORT):
            rows[stage] = StageRow(stage, status=SKIPPED, notes="speed_only=true")
    else:
        if plan.plain_strategy == recipe_strategy:
            rows[PLAIN_LOOP], plain_config = StageRow(PLAIN_LOOP, recipe_strategy, notes=(
                f"the recipe's strategy is the plain one ({recipe_strategy}): measured once, in the row above")), None
        else:
            rows[PLAIN_LOOP], plain_config = loop_stage(plan, PLAIN_LOOP, plan.plain_strategy, GPU_CHECK_PLAIN_RUN)
        resumed = recipe_config or plain_config  # the recipe's loop, or the plain one where the recipe's could not run
        rows[RESUME] = resume_stage(plan, resumed)
        if rank_zero:
            rows[EXPORT] = export_stage(plan, resumed)
    if not rank_zero:
        return GpuCheckResult(str(plan.device), config.config, list(rows.values()), [], False)
    enforced = config.targets.enforce if config.targets.enforce is not None else plan.device.type == "cuda"
    failures = judge(rows, config, enforced, plan.dtypes_of(plan.plain_strategy) == plan.ceiling_dtypes, plan.world)
    result = GpuCheckResult(device_name(plan.device, plan.world), config.config, list(rows.values()), failures,
                            enforced, head_share=mlm_head_share(rows), profile=profiled,
                            loop_profile=profiler.result if profiler is not None else None)
    result.paths = write_reports(result, plan)
    print(result.paths["markdown"].read_text())
    return result


def make_plan(config: GpuCheckConfig) -> Plan:
    """The recipe with the check's overrides, on the devices found, checked like a pretraining run before it starts
    (tokenizer, model config, data source)."""
    recipe = load_pretrain_config(config.config, config.overrides)
    if recipe.phases:
        raise ConfigError("invalid config key 'phases': the check runs one phase's settings; check a phased recipe "
                          "with phases=[] and that phase's keys as overrides")
    for override in config.overrides:
        if (key := override.partition("=")[0].strip()) in ("trainer.devices", "trainer.num_nodes"):
            raise ConfigError(f"invalid config key {key!r}: the check runs on the devices of this node; set the "
                              f"check's own key devices=N to use fewer")
    recipe, left_out = steady_state(recipe)
    on_gpu = trains_on_gpu(recipe.trainer)
    recipe = decide_compile(recipe, "cuda" if on_gpu else "cpu")  # model.compile=auto, as the recipe's run decides it
    devices = (torch.cuda.device_count() if on_gpu else 1) if config.devices == "auto" else int(config.devices)
    trainer = dataclasses.replace(recipe.trainer, devices=devices, num_nodes=1)  # one node: this one
    data = recipe.data
    if not data.validation_docs:  # the check validates once: two micro-batches per rank of held-out documents
        data = dataclasses.replace(data, validation_docs=2 * trainer.micro_batch_size * devices * trainer.num_nodes)
    recipe = dataclasses.replace(recipe, trainer=trainer, data=data)
    recipe.validate()
    if config.profile and recipe.trainer.profiler == "pytorch":  # one torch.profiler at a time (it raises otherwise)
        raise ConfigError("invalid config key 'trainer.profiler': profile=true records the loop with torch.profiler "
                          "already; drop trainer.profiler=pytorch, or profile=true")
    check_log_interval(config, recipe)
    if recipe.model.compile:
        untimed = compile_warmup_steps(recipe.model.compile_mode)
        if config.ceiling_warmup < untimed:
            raise ConfigError(f"invalid config key 'ceiling_warmup': model.compile=true with compile_mode="
                              f"{recipe.model.compile_mode} needs {untimed} untimed step(s), or compilation is timed; "
                              f"got {config.ceiling_warmup}")
    # resume=true: the recipe's own output_dir may hold checkpoints; they are not refused, nor used
    tokenizer, model_config, _ = prepare(dataclasses.replace(recipe, resume=True))
    world = devices * trainer.num_nodes
    plain = config.plain_strategy if config.plain_strategy != "auto" else ("auto" if world == 1 else "ddp")
    if not config.speed_only:  # the plain loop's config, checked now rather than after the recipe's loop has run
        try:
            dataclasses.replace(recipe, trainer=dataclasses.replace(recipe.trainer, strategy=plain)).validate()
        except ConfigError as err:
            raise ConfigError(f"invalid config key 'plain_strategy': {plain} cannot run this recipe: {err}") from err
    return Plan(config, recipe, tokenizer, model_config, torch.device("cuda" if on_gpu else "cpu"), plain,
                Path(config.output_dir), left_out=left_out)


def steady_state(recipe: PretrainConfig) -> tuple[PretrainConfig, tuple[str, ...]]:
    """The recipe without its batch-size warm-up, and with its masking-rate schedule's highest rate throughout, and
    the keys changed: the check's loops of a few dozen steps would run their first steps' micro-batch and rate,
    while the ceilings and the FLOP count take trainer.micro_batch_size and masking.rate, and the memory estimate
    the highest rate (the run's peak, which the check is to prove fits)."""
    left_out = []
    if recipe.trainer.batch_size_warmup != BatchSizeWarmupConfig():
        left_out.append("trainer.batch_size_warmup")
        recipe = dataclasses.replace(recipe, trainer=dataclasses.replace(recipe.trainer,
                                                                         batch_size_warmup=BatchSizeWarmupConfig()))
    if recipe.masking.rate_schedule:
        left_out.append(f"masking.rate_schedule (the highest of it and masking.rate, {recipe.masking.highest_rate:g}, "
                        f"throughout)")
        recipe = dataclasses.replace(recipe, masking=dataclasses.replace(recipe.masking, rate_schedule=[],
                                                                         rate=recipe.masking.highest_rate))
    return recipe, tuple(left_out)


def check_log_interval(config: GpuCheckConfig, recipe: PretrainConfig) -> None:
    """A loop's tokens/s needs one whole log interval from `timed_from` (after the warm-up, and the profiled steps
    with the one the profiler stops in), after the first read (which has none)."""
    if not logs_tokens_per_s(config, recipe):
        profiled = (f", {config.profile_steps} profiled steps and the one the profiler stops in (profile=true)"
                    if config.profile else "")
        raise ConfigError(f"invalid config key 'steps': {config.steps} steps log no tokens/s after the "
                          f"{config.warmup_steps} warm-up steps{profiled} at logging.log_every_n_steps="
                          f"{log_interval(config, recipe)}; set steps={fewest_steps(config, recipe)} or more, or "
                          f"lower warmup_steps{', profile_steps' * config.profile} or logging.log_every_n_steps")


def logs_tokens_per_s(config: GpuCheckConfig, recipe: PretrainConfig) -> bool:
    interval = log_interval(config, recipe)
    return max(2, math.ceil(config.timed_from / interval) + 1) * interval <= config.steps


def fewest_steps(config: GpuCheckConfig, recipe: PretrainConfig) -> int:
    """The fewest steps whose loops log tokens/s (below logging.log_every_n_steps the interval is the steps)."""
    return next(steps for steps in itertools.count(config.steps + 1)
                if logs_tokens_per_s(dataclasses.replace(config, steps=steps), recipe))


def clear_earlier_check(output_dir: Path, overwrite: bool) -> None:
    """An earlier check's report and runs are refused unless `overwrite`, which removes them (and nothing else)."""
    claim_output_dir(output_dir, GPU_CHECK, where=f"invalid config key 'output_dir': {output_dir}", noun="output_dir",
                     earlier="invalid config key 'output_dir': {directory} holds an earlier check ({held}): choose "
                             "another output_dir, or set overwrite=true to replace it",
                     overwrite=overwrite, flag="overwrite=true")
    clear_output_dir(output_dir, GPU_CHECK)


def device_name(device: torch.device, devices: int) -> str:
    """The devices the check ran on (`devices` of this node's GPUs: devices=N may use fewer than it has)."""
    if device.type == "cuda":
        return f"{devices} x {torch.cuda.get_device_name(device)}"
    return f"CPU ({torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------------------------- targets, reports
def judge(rows: dict[str, StageRow], config: GpuCheckConfig, enforced: bool,
          plain_as_ceiling: bool = True, world: int = 1) -> list[str]:
    """Fills the ratios in and returns the failures: failed stages, and (when enforced) ratios under target. The
    loops are judged against the ceiling with the MLM head: what they run, its FLOPs counted as theirs are, in the
    recipe's loop's arithmetic (Plan.ceiling_dtypes). `plain_as_ceiling`: whether the plain loop computes the same
    way; where it does not (float32 weights under autocast beside DeepSpeed's bf16 weights) it has no loop/ceiling,
    and strategy/plain compares the two loops. `world`: the loops' devices (their tokens/s are all devices', the
    ceiling's one device's; MFU is per device already)."""
    ceiling, recipe, plain = rows[CEILING], rows[RECIPE_LOOP], rows[PLAIN_LOOP]
    targets = config.targets
    if not plain_as_ceiling and plain.tokens_per_s is not None:
        plain.notes += ("; no loop/ceiling: its weights and autocast are not the ceiling's (the recipe's loop's, "
                        "in the ceiling row's note)")
    for row in (recipe, plain) if plain_as_ceiling else (recipe,):
        if row.tokens_per_s is None or ceiling.tokens_per_s is None:
            continue
        if row.mfu is not None and ceiling.mfu:
            row.loop_vs_ceiling, row.ratio_basis = row.mfu / ceiling.mfu, "MFU"
        else:
            row.loop_vs_ceiling = row.tokens_per_s / world / ceiling.tokens_per_s
            row.ratio_basis = "tokens/s per device"
    if recipe.tokens_per_s is not None and plain.tokens_per_s is not None:
        recipe.strategy_vs_plain = recipe.tokens_per_s / plain.tokens_per_s
    elif recipe.status == FAILED and plain.tokens_per_s is not None:  # its own figures stand, the comparison does not
        plain.notes += "; strategy/plain not measured: the recipe's loop failed (its row says why)"
    failures = [f"{row.stage}: {row.error}" for row in rows.values() if row.status == FAILED]
    checks = [(row, "loop/ceiling", row.loop_vs_ceiling, targets.loop_vs_ceiling) for row in (recipe, plain)]
    checks.append((recipe, "strategy/plain", recipe.strategy_vs_plain, targets.strategy_vs_plain))
    for row, name, ratio, target in checks:
        if ratio is None or ratio >= target:
            continue
        if enforced:
            failures.append(f"{row.stage}: {name} {ratio:.2f} is under its target {target:g}")
            row.status = BELOW_TARGET if row.status == OK else row.status
        else:
            row.notes += f"; {name} {ratio:.2f} under its target {target:g} (not enforced)"
    return failures


def mlm_head_share(rows: dict[str, StageRow]) -> float | None:
    """The MLM head's share of the ceiling's step: 1 - the encoder-alone step / the with-head step (both time the
    same tokens, so the steps' ratio is their tokens/s' inverse ratio); None unless both ran."""
    encoder, ceiling = rows[ENCODER].tokens_per_s, rows[CEILING].tokens_per_s
    return None if encoder is None or ceiling is None else 1 - ceiling / encoder


def write_reports(result: GpuCheckResult, plan: Plan) -> dict[str, Path]:
    paths = {"markdown": plan.output_dir / GPU_CHECK_MD, "json": plan.output_dir / GPU_CHECK_JSON}
    write_atomically(paths["markdown"], [markdown_report(result, plan)])
    summary = {"device": result.device, "recipe": result.recipe, "overrides": plan.config.overrides,
               "model_overrides": dict(plan.recipe.model.overrides),
               "steps": plan.config.steps, "warmup_steps": plan.config.warmup_steps,
               "timed_from": plan.config.timed_from,
               "resume_steps": plan.config.resume_steps, "micro_batch_size": plan.recipe.trainer.micro_batch_size,
               "max_length": plan.recipe.data.max_length, "precision": plan.precision, "world_size": plan.world,
               "left_out": list(plan.left_out),
               "targets": dataclasses.asdict(plan.config.targets), "enforced": result.enforced,
               "rows": [dataclasses.asdict(row) for row in result.rows], "mlm_head_share": result.head_share,
               "failures": result.failures, "passed": result.passed}
    for key, profile, files in (("profile", result.profile, CEILING_PROFILE_FILES),
                                ("loop_profile", result.loop_profile, LOOP_PROFILE_FILES)):
        if profile is not None:
            summary[key] = profile_summary(profile, files)
    write_atomically(paths["json"], [json.dumps(summary, indent=1) + "\n"])
    return paths


def model_overrides_text(recipe) -> str:
    """The model's overrides the run resolved, from the recipe's file and the command line: the machine's choices
    (kernels, attention kernel, the decoder's padding) change the speed, and a recipe's file may set them."""
    return " ".join(f"{key}={value}" for key, value in sorted(recipe.model.overrides.items())) or "none"


def markdown_report(result: GpuCheckResult, plan: Plan) -> str:
    config, recipe = plan.config, plan.recipe
    targets = config.targets
    lines = [f"# GPU check: {result.recipe} on {result.device}", "",
             f"{plan.world} device(s); micro-batch {recipe.trainer.micro_batch_size} x length "
             f"{recipe.data.max_length}, accumulation {recipe.trainer.accumulate_grad_batches}, {plan.precision}; "
             f"loops of {config.steps} steps (tokens/s and MFU from step {config.timed_from}: after "
             f"{config.warmup_steps} warm-up steps"
             + (f", {config.profile_steps} profiled and the profiler's stop" if config.profile else "") + "), "
             + ("the recipe's loop only (speed_only=true)" if config.speed_only else f"resume +{config.resume_steps}")
             + f". Recipe overrides: {' '.join(config.overrides) or 'none'}"
             + f"; the model's, as run (the recipe's file and these): {model_overrides_text(recipe)}"
             + (f"; left out, so that the loops run the ceiling's micro-batch and masking rate "
                f"({recipe.masking.rate:g}): {'; '.join(plan.left_out)}" if plan.left_out else "")
             + f". Targets: loop/ceiling >= "
             f"{targets.loop_vs_ceiling:g}, strategy/plain >= {targets.strategy_vs_plain:g} "
             f"({'enforced' if result.enforced else 'reported, not enforced'}). "
             f"tokens/s: the loops' over all {plan.world} device(s), the encoder's and the ceiling's on one. "
             f"The ceiling is the model with its MLM head (what the loops run); the encoder alone is for reference"
             + (f": the MLM head (its decoder and loss) is {result.head_share:.1%} of the ceiling's step (1 - encoder "
                f"step / with-head step)." if result.head_share is not None else "."), "",
             "| stage | strategy | tokens/s | MFU | loop/ceiling | strategy/plain | peak memory / estimate | status | "
             "notes |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for row in result.rows:
        ratio = f"{row.loop_vs_ceiling:.2f} ({row.ratio_basis})" if row.loop_vs_ceiling is not None else ""
        status = row.status + (f": {row.error}" if row.error else "")
        lines.append(f"| {row.stage} | {row.strategy} | {_number(row.tokens_per_s, '{:,.0f}')} | "
                     f"{_number(row.mfu, '{:.1%}')} | {ratio} | {_number(row.strategy_vs_plain, '{:.2f}')} | "
                     f"{_memory(row)} | {status} | {row.notes} |".replace("\n", " "))
    lines += ["", "Result: " + ("PASSED" if result.passed else "FAILED"), ""]
    lines += [f"- {failure}" for failure in result.failures]
    section = profile_section(result.profile, result.loop_profile)
    if section:
        lines += ["", *section]
    return "\n".join(lines).rstrip() + "\n"


def profile_summary(profile: KernelProfile, files: ProfileFiles) -> dict:
    """A profile's figures for gpu_check.json (ms; its files; the largest names no rule knows)."""
    return {"files": [files.trace, files.categories, files.names], "source": profile.source, "steps": profile.steps,
            "wall_ms": profile.wall_us / 1e3, "total_ms": profile.total_us / 1e3,
            "busy_ms": None if profile.busy_us is None else profile.busy_us / 1e3, "tokens": profile.tokens,
            "self_ms": {category: us / 1e3 for category, us in profile.self_us.items()},
            "other_names": [dataclasses.asdict(entry) for entry in profile.other_names()],
            "host_waits": None if profile.host_waits is None else dataclasses.asdict(profile.host_waits)}


def profile_section(ceiling: KernelProfile | None, loop: KernelProfile | None, top: int = 10) -> list[str]:
    """The profiles by category in ms per step of the ceiling's tokens (a step of the ceiling; the loop's time scaled
    to as many of its real tokens, the optimizer's share included) and their difference, with the names whose time
    the loop adds most; the device's busy share of the wall time; the largest names no rule knows (for a new rule).
    """
    subjects = [(title, recording) for title, recording in (("ceiling", ceiling), ("loop", loop))
                if recording is not None and recording.steps and recording.tokens]
    if not subjects:
        return []
    step_tokens = subjects[0][1].tokens / subjects[0][1].steps  # the ceiling's step; else the loop's optimizer step
    lines = ["## Profile: " + " and ".join({"ceiling": "the ceiling's step (model + MLM head)",
                                             "loop": "the recipe's loop"}[title] for title, _ in subjects), "",
             f"Self time of the {subjects[0][1].source} by category (neobert.instruments.kernel_profile.RULES), "
             f"in ms per step of {step_tokens:,.0f} tokens."]
    for title, recording in subjects:
        files = CEILING_PROFILE_FILES if title == "ceiling" else LOOP_PROFILE_FILES
        plural = "s" * (recording.steps != 1)
        what = (f"{recording.steps} step{plural}" if title == "ceiling" else
                f"{recording.steps} optimizer step{plural} after its warm-up, the optimizer included"
                + (", scaled to the ceiling's tokens" if len(subjects) == 2 else ""))
        lines[-1] += (f" {title.capitalize()}: {what} ({recording.tokens:,} tokens): "
                      f"{_timing(recording, step_tokens)}; trace {files.trace} (ui.perfetto.dev), every name in "
                      f"{files.names}.")
    header = "| category |" + "".join(f" {title} ms | share |" for title, _ in subjects)
    both = len(subjects) == 2
    header += " loop - ceiling ms |" if both else ""
    lines += ["", header, "|---|" + "---:|" * (header.count("|") - 2)]
    for category in CATEGORIES:
        row, per_step = f"| {category} |", []
        for _, recording in subjects:
            per_step.append(_per_step(recording.self_us[category], recording, step_tokens))
            row += f" {per_step[-1]:,.2f} | {recording.share(category):.1%} |"
        lines.append(row + (f" {per_step[1] - per_step[0]:+,.2f} |" if both else ""))
    if both:
        added = added_names(ceiling, loop, step_tokens)[:top]
        if added:
            lines += ["", f"Where the loop spends more than the ceiling, by name (ms per step, {len(added)}):", ""]
            lines += [f"- +{extra:,.2f} ms ({category}): `{_short(name)}`" for name, category, extra in added]
    for title, recording in subjects:
        if recording.host_waits is not None:
            lines += ["", f"Where the device waited on the host in the {title}'s recording (all its steps; "
                          f"neobert.instruments.host_waits):", "", *host_wait_lines(recording.host_waits)]
    for title, recording in subjects:
        others = recording.other_names(top)
        if others:
            lines += ["", f"The largest names in \"other\" of the {title} ({len(others)}, all its steps):", ""]
            lines += [f"- {entry.self_us / 1e3:,.2f} ms, {entry.calls} calls: `{_short(entry.name)}`"
                      for entry in others]
    return lines


def _per_step(us: float, recording: KernelProfile, step_tokens: float) -> float:
    """µs of a recording -> ms per step of `step_tokens` of its tokens."""
    return us / 1e3 * step_tokens / recording.tokens


def _timing(recording: KernelProfile, step_tokens: float) -> str:
    """Self time and wall time per step, and on a GPU the device's busy share of the wall time."""
    text = (f"{_per_step(recording.total_us, recording, step_tokens):,.2f} ms of self time in "
            f"{_per_step(recording.wall_us, recording, step_tokens):,.2f} ms of wall time (the profiler's overhead "
            f"included)")
    if recording.busy_us is not None:
        idle = _per_step(recording.wall_us - recording.busy_us, recording, step_tokens)
        text += f", the device busy {recording.busy_us / recording.wall_us:.0%} of it (idle {idle:,.2f} ms)"
    return text


def added_names(ceiling: KernelProfile, loop: KernelProfile, step_tokens: float) -> list[tuple[str, str, float]]:
    """(name, category, ms per step the loop spends beyond the ceiling) of every name whose time grows, the largest
    first: the optimizer's kernels, the strategy's copies and collectives, whatever else the loop runs."""
    in_ceiling = {entry.name: _per_step(entry.self_us, ceiling, step_tokens) for entry in ceiling.names}
    added = [(entry.name, entry.category, _per_step(entry.self_us, loop, step_tokens) - in_ceiling.get(entry.name, 0))
             for entry in loop.names]
    return sorted((item for item in added if item[2] > 0), key=lambda item: -item[2])


def _short(name: str, limit: int = 160) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _number(value: float | None, form: str) -> str:
    return "" if value is None else form.format(value)


def _memory(row: StageRow) -> str:
    if row.peak_memory_gib is None and row.memory_estimate_gib is None:
        return ""
    peak = "n/a" if row.peak_memory_gib is None else f"{row.peak_memory_gib:.1f}"
    estimate = "" if row.memory_estimate_gib is None else f" / {row.memory_estimate_gib:.1f}"
    ratio = (f" ({row.peak_memory_gib / row.memory_estimate_gib:.2f}x)"
             if row.peak_memory_gib is not None and row.memory_estimate_gib else "")
    return f"{peak}{estimate} GiB{ratio}"
