"""The GPU-node check (`python -m experiments.gpu_check --config neobert`; docs/pretraining.md, "First GPU run"):
one command that proves a node runs a pretraining recipe, and how well. On the devices it finds (every CUDA GPU of
the node; a CPU runs it too, end to end, with a tiny recipe), in order:

1. ceiling: the recipe's encoder alone, forward + backward at the recipe's micro-batch and length, in the loop's
   batch layout and precision: the throughput benchmark's training step (`neobert.eval.throughput`: its batch,
   its timed step, its FLOP count), tokens/s and MFU;
2. loops: the recipe's real training loop (`run_pretraining`) for `steps` steps under its own strategy (e.g.
   deepspeed_stage_2) and under the plain one (Lightning's auto on one device, ddp on several); tokens/s and MFU are
   those MLMPretrainingModule logs (train/tokens_per_sec, train/mfu in the run's metrics CSV), averaged over the
   log intervals after `warmup_steps`; a validation and a checkpoint at the last step;
3. resume: `resume_steps` more steps with resume=true from that checkpoint, which must start at step `steps`;
4. export: the end-of-run export, reloaded with NeoBERTForMaskedLM.from_pretrained and transformers'
   AutoModelForMaskedLM, one forward each (they must agree);
5. memory: each stage's peak device memory (torch.cuda.max_memory_allocated; n/a on a CPU) against the
   preflight's estimate for that stage's strategy (`neobert.jobs.preflight.memory_section`).

One Markdown table, printed and written to output_dir/gpu_check.md, and the same figures in gpu_check.json. A stage
that raises prints its traceback and is marked FAILED, and the others run where they can. `GpuCheckResult.failures`
names the failed stages and the ratios under their targets (`targets.*`, enforced on CUDA by default); the command
line exits 1 when there is any.

Several GPUs: the loops run in this process and Lightning starts the other ranks by running the same command again
(its script launcher); those ranks run the training stages only, and rank 0 measures and reports.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import statistics
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import lightning as L
import torch
from transformers import AutoModelForMaskedLM

from neobert.config import ConfigError
from neobert.config.gpu_check import GpuCheckConfig
from neobert.config.pretrain import PretrainConfig
from neobert.data.tokenizer import load_tokenizer
from neobert.errors import CheckpointError
from neobert.eval.flops import mfu, peak_flops
from neobert.eval.plots import read_curves
from neobert.eval.throughput import Batch, BenchModel, make_batch, neobert_forward, time_step
from neobert.jobs.cli import one_line
from neobert.jobs.preflight import GiB, Preflight, memory_section
from neobert.jobs.pretrain import load_pretrain_config, prepare, run_pretraining
from neobert.layout import (CONFIG_NAME, EXPORT_DIR, GPU_CHECK_JSON, GPU_CHECK_MD, GPU_CHECK_PLAIN_RUN,
                            GPU_CHECK_RECIPE_RUN, has_tokenizer, metrics_csvs, write_atomically)
from neobert.lit.checkpoints import newest_readable_checkpoint, verify_checkpoint
from neobert.lit.strategies import is_deepspeed
from neobert.lit.trainer import resolve_precision
from neobert.model import NeoBERT, NeoBERTForMaskedLM
from neobert.outputs import GPU_CHECK, claim_output_dir, clear_output_dir

OK, FAILED, SKIPPED, BELOW_TARGET = "ok", "FAILED", "skipped", "BELOW TARGET"
CEILING, RECIPE_LOOP, PLAIN_LOOP, RESUME, EXPORT = ("model alone (ceiling)", "loop, recipe's strategy",
                                                    "loop, plain strategy", "resume", "export + reload")
TOKENS_PER_S, MFU, VAL_LOSS = "train/tokens_per_sec", "train/mfu", "val/loss"
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
WEIGHT_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
EXPORT_TEXT = "The quick brown fox jumps over the {mask} dog."
RELOAD_TOLERANCE = 1e-4  # ours against transformers' on the same weights: the same code, so float noise only


@dataclass
class StageRow:
    """One row of the table. Memory in GiB; ratios are None where they do not apply."""

    stage: str
    strategy: str = ""
    status: str = OK
    tokens_per_s: float | None = None
    mfu: float | None = None
    loop_vs_ceiling: float | None = None
    ratio_basis: str = ""  # "MFU" (both known) or "tokens/s"
    strategy_vs_plain: float | None = None
    peak_memory_gib: float | None = None
    memory_estimate_gib: float | None = None
    notes: str = ""
    error: str = ""


@dataclass
class GpuCheckResult:
    device: str
    recipe: str
    rows: list[StageRow]
    failures: list[str]  # "stage: why", one per failed stage and per ratio under its target
    enforced: bool  # whether the ratio targets were enforced
    paths: dict[str, Path] = field(default_factory=dict)  # {"markdown", "json"}; empty on ranks other than 0

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class Plan:
    """What every stage shares: the recipe (with the check's devices and validation), its model and device."""

    config: GpuCheckConfig
    recipe: PretrainConfig
    tokenizer: object
    model_config: object
    device: torch.device
    plain_strategy: str
    output_dir: Path
    export_errors: list[str] = field(default_factory=list)  # exports that failed after a loop had trained

    @property
    def precision(self) -> str:
        return resolve_precision(self.recipe.trainer)

    @property
    def world(self) -> int:
        return self.recipe.trainer.num_devices * self.recipe.trainer.num_nodes


# ---------------------------------------------------------------------------------------------- the run
def run_gpu_check(config: GpuCheckConfig) -> GpuCheckResult:
    """Runs every stage (see the module docstring), writes the reports and returns them with the failures."""
    config.validate()
    plan = make_plan(config)  # config errors end here, before any stage
    rank_zero = is_global_zero()
    if rank_zero:
        clear_earlier_check(plan.output_dir, config.overwrite)
    rows = {CEILING: ceiling_stage(plan) if rank_zero else StageRow(CEILING, status=SKIPPED)}
    recipe_strategy = plan.recipe.trainer.strategy
    rows[RECIPE_LOOP], recipe_config = loop_stage(plan, RECIPE_LOOP, recipe_strategy, GPU_CHECK_RECIPE_RUN)
    if plan.plain_strategy == recipe_strategy:
        rows[PLAIN_LOOP], plain_config = StageRow(PLAIN_LOOP, recipe_strategy, notes=(
            f"the recipe's strategy is the plain one ({recipe_strategy}): measured once, in the row above")), None
    else:
        rows[PLAIN_LOOP], plain_config = loop_stage(plan, PLAIN_LOOP, plan.plain_strategy, GPU_CHECK_PLAIN_RUN)
    resumed = recipe_config or plain_config  # the recipe's loop, or the plain one where the recipe's could not run
    rows[RESUME] = resume_stage(plan, resumed)
    if not rank_zero:
        return GpuCheckResult(str(plan.device), config.config, list(rows.values()), [], False)
    rows[EXPORT] = export_stage(plan, resumed)
    enforced = config.targets.enforce if config.targets.enforce is not None else plan.device.type == "cuda"
    failures = judge(rows, config, enforced)
    result = GpuCheckResult(device_name(plan.device), config.config, list(rows.values()), failures, enforced)
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
    if any(override.partition("=")[0].strip() in ("trainer.devices", "trainer.num_nodes")
           for override in config.overrides):
        raise ConfigError("invalid config key 'trainer.devices': the check runs on the devices of this node; set the "
                          "check's own key devices=N to use fewer")
    on_gpu = torch.cuda.is_available() and recipe.trainer.accelerator in ("auto", "gpu", "cuda")
    devices = (torch.cuda.device_count() if on_gpu else 1) if config.devices == "auto" else int(config.devices)
    trainer = dataclasses.replace(recipe.trainer, devices=devices, num_nodes=1)  # one node: this one
    data = recipe.data
    if not data.validation_docs:  # the check validates once: two micro-batches per rank of held-out documents
        data = dataclasses.replace(data, validation_docs=2 * trainer.micro_batch_size * devices * trainer.num_nodes)
    recipe = dataclasses.replace(recipe, trainer=trainer, data=data)
    recipe.validate()
    check_log_interval(config, recipe)
    # resume=true: the recipe's own output_dir may hold checkpoints; they are not refused, nor used
    tokenizer, model_config, _ = prepare(dataclasses.replace(recipe, resume=True))
    world = devices * trainer.num_nodes
    plain = config.plain_strategy if config.plain_strategy != "auto" else ("auto" if world == 1 else "ddp")
    return Plan(config, recipe, tokenizer, model_config, torch.device("cuda" if on_gpu else "cpu"), plain,
                Path(config.output_dir))


def log_interval(config: GpuCheckConfig, recipe: PretrainConfig) -> int:
    """The steps between the module's metric reads in a loop (Lightning's log interval, build_trainer's rule)."""
    return min(recipe.logging.log_every_n_steps, config.steps)


def check_log_interval(config: GpuCheckConfig, recipe: PretrainConfig) -> None:
    """A loop's tokens/s needs one whole log interval after the warm-up, after the first read (which has none)."""
    interval = log_interval(config, recipe)
    reads = max(2, math.ceil(config.warmup_steps / interval) + 1)
    if reads * interval > config.steps:
        raise ConfigError(f"invalid config key 'steps': {config.steps} steps log no tokens/s after the "
                          f"{config.warmup_steps} warm-up steps at logging.log_every_n_steps={interval}; "
                          f"set steps={reads * interval} or more, or lower warmup_steps or logging.log_every_n_steps")


def is_global_zero() -> bool:
    """Rank 0 of the run: not one of the ranks Lightning's launcher (or torchrun, srun) started."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def clear_earlier_check(output_dir: Path, overwrite: bool) -> None:
    """An earlier check's report and runs are refused unless `overwrite`, which removes them (and nothing else)."""
    claim_output_dir(output_dir, GPU_CHECK, where=f"invalid config key 'output_dir': {output_dir}", noun="output_dir",
                     earlier="invalid config key 'output_dir': {directory} holds an earlier check ({held}): choose "
                             "another output_dir, or set overwrite=true to replace it",
                     overwrite=overwrite, flag="overwrite=true")
    clear_output_dir(output_dir, GPU_CHECK)


def attempt(row: StageRow, work: Callable[[], None]) -> None:
    """Runs one stage's work; an exception is printed with its traceback and marks the row FAILED (Ctrl-C is not
    caught: it stops the check)."""
    try:
        work()
    except Exception as err:  # noqa: BLE001 - any failure of a stage is reported, and the check goes on
        traceback.print_exc()
        row.status, row.error = FAILED, f"{type(err).__name__}: {one_line(err)}"


# ---------------------------------------------------------------------------------------------- device memory
def start_peak_memory(device: torch.device) -> None:
    gc.collect()  # the stage before's model and optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}"
    return f"CPU ({torch.get_num_threads()} threads)"


def memory_estimate_gib(plan: Plan, loop: PretrainConfig) -> float:
    """The preflight's per-GPU total (model states for the loop's strategy + activations) for this loop."""
    with torch.device("meta"):  # counted, never allocated
        model = NeoBERTForMaskedLM(plan.model_config)
    report = Preflight()
    gpu = torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "cpu"
    return memory_section(report, loop, model, sum(p.numel() for p in model.parameters()), gpu) / GiB


# ---------------------------------------------------------------------------------------------- 1. the ceiling
def ceiling_stage(plan: Plan) -> StageRow:
    row = StageRow(CEILING, "none (one model, no optimizer)")

    def work() -> None:
        start_peak_memory(plan.device)
        row.tokens_per_s, row.mfu = measure_ceiling(plan)
        row.peak_memory_gib = peak_memory_gib(plan.device)
        trainer, data = plan.recipe.trainer, plan.recipe.data
        row.notes = (f"encoder forward + backward, {trainer.micro_batch_size} x {data.max_length} tokens, "
                     f"{plan.precision}, median of {plan.config.ceiling_repeats}")

    attempt(row, work)
    return row


def measure_ceiling(plan: Plan) -> tuple[float, float | None]:
    """(tokens/s, MFU or None where the device has no published peak) of the recipe's encoder alone, timed by the
    throughput benchmark's step on its full-length batch of micro_batch_size x data.max_length tokens (laid end to
    end with cu_seqlens where the loop is: packing or data.unpad)."""
    recipe, model_config, device = plan.recipe, plan.model_config, plan.device
    torch.manual_seed(recipe.trainer.seed)
    bench = BenchModel("neobert", NeoBERT(model_config), model_config.num_hidden_layers, model_config.hidden_size,
                       model_config.max_length, model_config.vocab_size, model_config.pad_token_id, True,
                       neobert_forward)
    bench.module.to(device=device, dtype=WEIGHT_DTYPES.get(plan.precision, torch.float32))
    if recipe.model.compile:
        bench.module = torch.compile(bench.module, dynamic=False)
    batch = ceiling_batch(plan)
    autocast = AUTOCAST_DTYPES.get(plan.precision)
    for _ in range(plan.config.ceiling_warmup):
        time_step(bench, batch, True, device, autocast)
    step = statistics.median(time_step(bench, batch, True, device, autocast)
                             for _ in range(plan.config.ceiling_repeats))
    tokens_per_s = batch.real_tokens / step
    peak = peak_flops(device)
    per_token = bench.flops_per_token(recipe.data.max_length, training=True)
    return tokens_per_s, (mfu(tokens_per_s, per_token, peak) if peak else None)


def ceiling_batch(plan: Plan) -> Batch:
    data, model_config = plan.recipe.data, plan.model_config
    rows, length = plan.recipe.trainer.micro_batch_size, data.max_length
    batch = make_batch(rows, length, "full", model_config.vocab_size, model_config.pad_token_id, plan.device,
                       plan.recipe.trainer.seed)
    if data.packing == "none" and not data.unpad:
        return batch
    # The loop's layout: rows end to end with cu_seqlens (varlen attention), one full-length document per row.
    cu_seqlens = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=plan.device)
    return Batch(batch.input_ids.reshape(-1), None, batch.real_tokens, cu_seqlens, length)


# ---------------------------------------------------------------------------------------------- 2. the loops
class StepProbe(L.Callback):
    """The global steps a run started and ended at, and its Trainer (whether fit finished)."""

    def __init__(self) -> None:
        self.trainer: L.Trainer | None = None
        self.started: int | None = None
        self.ended: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.trainer, self.started = trainer, trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.ended = trainer.global_step

    @property
    def trained(self) -> bool:
        return self.trainer is not None and self.trainer.state.finished


def train(plan: Plan, run: PretrainConfig, label: str) -> StepProbe:
    """run_pretraining with a probe. A failure after training finished (the export, the summary) is the export
    stage's: printed and kept in plan.export_errors, while this stage keeps its figures."""
    probe = StepProbe()
    try:
        run_pretraining(run, extra_callbacks=[probe])
    except Exception as err:
        if not probe.trained:
            raise
        traceback.print_exc()
        plan.export_errors.append(f"after the {label}: {type(err).__name__}: {one_line(err)}")
    return probe


def loop_config(plan: Plan, strategy: str, run_name: str) -> PretrainConfig:
    """The recipe for `steps` steps under `strategy` in output_dir/run_name, validating and checkpointing at the
    last step, with the CSV logger; no unigram baseline (it is not the loop); the export in the run directory."""
    steps = plan.config.steps
    trainer = dataclasses.replace(plan.recipe.trainer, strategy=strategy, max_steps=steps,
                                  checkpoint_every_n_steps=steps, eval_every_n_steps=steps)
    data = dataclasses.replace(plan.recipe.data, baseline_docs=0)
    logging = plan.recipe.logging  # the CSV logger writes what the loop's figures are read from
    if "csv" not in logging.loggers:
        logging = dataclasses.replace(logging, loggers=[*logging.loggers, "csv"])
    run = dataclasses.replace(plan.recipe, trainer=trainer, data=data, logging=logging,
                              output_dir=str(plan.output_dir / run_name), export_dir=None, resume=False)
    run.validate()
    return run


def unavailable(strategy: str, device: torch.device) -> str | None:
    """Why `strategy` cannot run here, or None."""
    if is_deepspeed(strategy) and device.type != "cuda":
        return f"{strategy} needs CUDA: not run on this CPU (the plain loop stands in for it)"
    if is_deepspeed(strategy) and importlib.util.find_spec("deepspeed") is None:
        return f"{strategy} needs the deepspeed package (pip install -e '.[gpu]')"
    return None


def loop_stage(plan: Plan, title: str, strategy: str, run_name: str) -> tuple[StageRow, PretrainConfig | None]:
    """(the row, the loop's config when it trained)."""
    row = StageRow(title, strategy)
    reason = unavailable(strategy, plan.device)
    if reason:
        row.status, row.notes = SKIPPED, reason
        return row, None
    run = loop_config(plan, strategy, run_name)
    trained = []

    def work() -> None:
        try:
            row.memory_estimate_gib = memory_estimate_gib(plan, run)
        except Exception as err:  # noqa: BLE001 - an estimate the preflight cannot make is noted, not fatal
            row.notes = f"no memory estimate ({type(err).__name__}: {one_line(err)}); "
        start_peak_memory(plan.device)
        probe = train(plan, run, title)
        row.peak_memory_gib = peak_memory_gib(plan.device)
        trained.append(probe.trained)
        row.tokens_per_s, row.mfu, validation = loop_figures(plan, run)
        checkpoint, _ = newest_readable_checkpoint(run.output_dir)
        if checkpoint is None or verify_checkpoint(checkpoint) != plan.config.steps:
            raise CheckpointError(f"{run.output_dir}: no checkpoint of step {plan.config.steps} was written")
        row.notes += (f"steps {plan.config.warmup_steps}-{plan.config.steps - 1} of {plan.config.steps}; "
                      f"validation loss {validation:.4f}; checkpoint {checkpoint.name} (step {plan.config.steps})")

    attempt(row, work)
    return row, (run if any(trained) else None)


def loop_figures(plan: Plan, run: PretrainConfig) -> tuple[float, float | None, float]:
    """(tokens/s, MFU or None, the final validation loss) from the run's metrics CSV: the mean of the log intervals
    whose steps all come after the warm-up."""
    interval = log_interval(plan.config, run)
    curves = read_curves(metrics_csvs(run.output_dir), [TOKENS_PER_S, MFU, VAL_LOSS])

    def after_warmup(points: dict[int, float]) -> list[float]:
        return [value for step, value in sorted(points.items()) if step - interval + 1 >= plan.config.warmup_steps]

    rates, mfus = after_warmup(curves[TOKENS_PER_S]), after_warmup(curves[MFU])
    if not rates:
        raise RuntimeError(f"{run.output_dir}: no {TOKENS_PER_S} logged after the warm-up in its metrics CSV")
    if not curves[VAL_LOSS]:
        raise RuntimeError(f"{run.output_dir}: no {VAL_LOSS} logged: the validation did not run")
    return statistics.fmean(rates), (statistics.fmean(mfus) if mfus else None), curves[VAL_LOSS][max(curves[VAL_LOSS])]


# ---------------------------------------------------------------------------------------------- 3. the resume
def resume_stage(plan: Plan, loop: PretrainConfig | None) -> StageRow:
    steps, more = plan.config.steps, plan.config.resume_steps
    row = StageRow(f"{RESUME} +{more} steps", loop.trainer.strategy if loop else "")
    if loop is None:
        row.status, row.notes = SKIPPED, "no loop trained: nothing to resume"
        return row
    run = dataclasses.replace(loop, resume=True, trainer=dataclasses.replace(loop.trainer, max_steps=steps + more))

    def work() -> None:
        checkpoint, _ = newest_readable_checkpoint(run.output_dir)
        if checkpoint is None:
            raise CheckpointError(f"{run.output_dir} holds no readable checkpoint to resume from")
        saved = verify_checkpoint(checkpoint)
        start_peak_memory(plan.device)
        probe = train(plan, run, row.stage)
        row.peak_memory_gib = peak_memory_gib(plan.device)
        expected = (steps, steps, steps + more)
        if (saved, probe.started, probe.ended) != expected:
            raise CheckpointError(f"expected a resume from the checkpoint of step {steps} to start there and end at "
                                  f"step {steps + more}; the checkpoint {checkpoint.name} is of step {saved}, and the "
                                  f"run started at step {probe.started} and ended at step {probe.ended}")
        row.notes = f"from {checkpoint.name} (step {saved}): started at step {probe.started}, ended at {probe.ended}"

    attempt(row, work)
    return row


# ---------------------------------------------------------------------------------------------- 4. the export
def export_stage(plan: Plan, loop: PretrainConfig | None) -> StageRow:
    row = StageRow(EXPORT)
    if loop is None:
        row.status, row.notes = SKIPPED, "no loop trained: nothing exported"
        return row
    attempt(row, lambda: setattr(row, "notes", reload_export(Path(loop.output_dir) / EXPORT_DIR, plan)))
    if plan.export_errors:
        row.status = FAILED
        row.error = "; ".join(plan.export_errors + ([row.error] if row.error else []))
    return row


def reload_export(export_dir: Path, plan: Plan) -> str:
    """Loads the export with our loader and with transformers' Auto class and runs one forward through each."""
    if not (export_dir / CONFIG_NAME).is_file():
        raise CheckpointError(f"{export_dir}: no export ({CONFIG_NAME} is missing)")
    tokenizer = load_tokenizer(str(export_dir)) if has_tokenizer(export_dir) else plan.tokenizer
    inputs = tokenizer(EXPORT_TEXT.format(mask=tokenizer.mask_token or ""), return_tensors="pt")
    ours = NeoBERTForMaskedLM.from_pretrained(export_dir).eval()
    theirs = AutoModelForMaskedLM.from_pretrained(export_dir).eval()
    with torch.inference_mode():
        logits = ours(inputs["input_ids"], inputs["attention_mask"]).logits
        auto_logits = theirs(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    expected = (1, inputs["input_ids"].shape[1], ours.config.vocab_size)
    if tuple(logits.shape) != expected or not torch.isfinite(logits).all():
        raise RuntimeError(f"{export_dir}: the reloaded model's logits are {list(logits.shape)}"
                           f"{'' if torch.isfinite(logits).all() else ', not all finite'}; expected {list(expected)}")
    difference = (logits - auto_logits).abs().max().item()
    if difference > RELOAD_TOLERANCE:
        raise RuntimeError(f"{export_dir}: NeoBERTForMaskedLM and AutoModelForMaskedLM disagree by {difference:.2e}")
    return (f"{export_dir}: NeoBERTForMaskedLM and AutoModelForMaskedLM, logits {list(expected)}, "
            f"agree to {difference:.1e}")


# ---------------------------------------------------------------------------------------------- targets, reports
def judge(rows: dict[str, StageRow], config: GpuCheckConfig, enforced: bool) -> list[str]:
    """Fills the ratios in and returns the failures: failed stages, and (when enforced) ratios under target."""
    ceiling, recipe, plain = rows[CEILING], rows[RECIPE_LOOP], rows[PLAIN_LOOP]
    targets = config.targets
    for row in (recipe, plain):
        if row.tokens_per_s is None or ceiling.tokens_per_s is None:
            continue
        if row.mfu is not None and ceiling.mfu:
            row.loop_vs_ceiling, row.ratio_basis = row.mfu / ceiling.mfu, "MFU"
        else:
            row.loop_vs_ceiling, row.ratio_basis = row.tokens_per_s / ceiling.tokens_per_s, "tokens/s"
    if recipe.tokens_per_s is not None and plain.tokens_per_s is not None:
        recipe.strategy_vs_plain = recipe.tokens_per_s / plain.tokens_per_s
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


def write_reports(result: GpuCheckResult, plan: Plan) -> dict[str, Path]:
    paths = {"markdown": plan.output_dir / GPU_CHECK_MD, "json": plan.output_dir / GPU_CHECK_JSON}
    write_atomically(paths["markdown"], [markdown_report(result, plan)])
    summary = {"device": result.device, "recipe": result.recipe, "overrides": plan.config.overrides,
               "steps": plan.config.steps, "warmup_steps": plan.config.warmup_steps,
               "resume_steps": plan.config.resume_steps, "micro_batch_size": plan.recipe.trainer.micro_batch_size,
               "max_length": plan.recipe.data.max_length, "precision": plan.precision, "world_size": plan.world,
               "targets": dataclasses.asdict(plan.config.targets), "enforced": result.enforced,
               "rows": [dataclasses.asdict(row) for row in result.rows], "failures": result.failures,
               "passed": result.passed}
    write_atomically(paths["json"], [json.dumps(summary, indent=1) + "\n"])
    return paths


def markdown_report(result: GpuCheckResult, plan: Plan) -> str:
    config, recipe = plan.config, plan.recipe
    targets = config.targets
    lines = [f"# GPU check: {result.recipe} on {result.device}", "",
             f"{plan.world} device(s); micro-batch {recipe.trainer.micro_batch_size} x length "
             f"{recipe.data.max_length}, accumulation {recipe.trainer.accumulate_grad_batches}, {plan.precision}; "
             f"loops of {config.steps} steps (tokens/s and MFU after {config.warmup_steps} warm-up steps), resume "
             f"+{config.resume_steps}. Targets: loop/ceiling >= {targets.loop_vs_ceiling:g}, strategy/plain >= "
             f"{targets.strategy_vs_plain:g} ({'enforced' if result.enforced else 'reported, not enforced'}).", "",
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
    return "\n".join(lines).rstrip() + "\n"


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
