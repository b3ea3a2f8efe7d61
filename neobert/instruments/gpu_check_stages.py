"""The stages of the GPU-node check (`neobert.instruments.gpu_check`, which plans, runs, judges and reports them): each
takes the Plan and returns its StageRow, a failure caught and marked FAILED by `attempt`.

1. the ceilings: the recipe's encoder alone, for reference (`encoder_stage`, the throughput benchmark's timed
   step), then its model with the MLM head, one step as the pretraining module runs it on a batch built as the loop
   builds it (`head_ceiling_stage`): the ceiling the loops are judged against; with `profile`, a torch.profiler
   recording of that step and its self time by kind of kernel (`profile_stage`);
2. the loops and 3. the resume from the loop's checkpoint: `neobert.instruments.gpu_check_loops`;
4. the export, reloaded by our loader and transformers' (`export_stage`);
and each stage's peak device memory against the preflight's estimate.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import io
import importlib.util
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import profile
from transformers import AutoModelForMaskedLM

from neobert.config.gpu_check import GpuCheckConfig
from neobert.config.pretrain import CUDA_GRAPH_MODES, PretrainConfig
from neobert.data.masking import MLMMasker
from neobert.data.pretraining import BatchBuilder
from neobert.data.tokenizer import load_tokenizer
from neobert.errors import CheckpointError
from neobert.eval.flops import mfu, peak_flops
from neobert.instruments.encoders import Batch, BenchModel, make_batch, neobert_forward, rows_as_documents
from neobert.instruments.kernel_profile import NAME_COLUMNS, KernelProfile, profiler_activities, summarise_events
from neobert.instruments.preflight import GiB, Preflight, memory_section
from neobert.instruments.timing import synchronize, time_step
from neobert.jobs.cli import one_line
from neobert.layout import (CONFIG_NAME, EXPORT_DIR, GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV,
                            GPU_CHECK_LOOP_TRACE, GPU_CHECK_PROFILE_CSV, GPU_CHECK_PROFILE_NAMES_CSV, GPU_CHECK_TRACE,
                            has_tokenizer, write_atomically)
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.lit.strategies import is_deepspeed, loop_compute_dtype, loop_dtypes
from neobert.lit.trainer import resolve_precision
from neobert.model import NeoBERT, NeoBERTForMaskedLM
from neobert.model.heads import IGNORE_INDEX

OK, FAILED, SKIPPED, BELOW_TARGET = "ok", "FAILED", "skipped", "BELOW TARGET"
ENCODER, CEILING, PROFILE = "encoder alone (reference)", "model + MLM head (ceiling)", "profile: model + MLM head"
RECIPE_LOOP, PLAIN_LOOP, RESUME, EXPORT = "loop, recipe's strategy", "loop, plain strategy", "resume", "export + reload"
TOKENS_PER_S, MFU, VAL_LOSS = "train/tokens_per_sec", "train/mfu", "val/loss"
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
    ratio_basis: str = ""  # "MFU" (both known) or "tokens/s per device"
    strategy_vs_plain: float | None = None
    peak_memory_gib: float | None = None
    memory_estimate_gib: float | None = None
    notes: str = ""
    error: str = ""


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
    left_out: tuple[str, ...] = ()  # the recipe's schedules the check does not run (gpu_check.steady_state)

    @property
    def precision(self) -> str:
        return resolve_precision(self.recipe.trainer)

    @property
    def world(self) -> int:
        return self.recipe.trainer.num_devices * self.recipe.trainer.num_nodes

    @property
    def ceiling_dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        """(weights, autocast) of the recipe's loop as it runs here (`dtypes_of`), for the ceilings."""
        return self.dtypes_of(self.recipe.trainer.strategy)

    def runs_here(self, strategy: str) -> str:
        """The strategy a loop under `strategy` runs with here: itself, or the plain loop standing in for a DeepSpeed
        that cannot run on this machine."""
        return "auto" if is_deepspeed(strategy) and unavailable(strategy, self.device) is not None else strategy

    @property
    def ceiling_compute_dtype(self) -> torch.dtype:
        """The dtype the ceilings' matmuls compute in (`loop_compute_dtype` of the recipe's loop as it runs here)."""
        return loop_compute_dtype(self.runs_here(self.recipe.trainer.strategy), self.precision)

    def dtypes_of(self, strategy: str) -> tuple[torch.dtype, torch.dtype | None]:
        """(weights, autocast) a loop under `strategy` computes with here (`loop_dtypes` of `runs_here`). The
        ceilings take the recipe's loop's, so that no weight is cast in their step that the loop does not cast."""
        return loop_dtypes(self.runs_here(strategy), self.precision)

    @property
    def arithmetic(self) -> str:
        """The ceilings' arithmetic in words."""
        weights, autocast = self.ceiling_dtypes
        words = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        if autocast is None:
            deepspeed_half = is_deepspeed(self.runs_here(self.recipe.trainer.strategy)) and weights != torch.float32
            how = " (as DeepSpeed runs it)" if deepspeed_half else ""
            return f"{self.precision}: {words[weights]} weights, no autocast{how}"
        return f"{self.precision}: {words[weights]} weights under {words[autocast]} autocast"


# ---------------------------------------------------------------------------------------------- shared by the stages
def log_interval(config: GpuCheckConfig, recipe: PretrainConfig) -> int:
    """The steps between the module's metric reads in a loop (Lightning's log interval, build_trainer's rule)."""
    return min(recipe.logging.log_every_n_steps, config.steps)


STAGE_DONE = "gpu_check stage done:"  # how the log says a stage's row as soon as it is known


def attempt(row: StageRow, work: Callable[[], None]) -> None:
    """Runs one stage's work; an exception is printed with its traceback and marks the row FAILED (Ctrl-C is not
    caught: it stops the check). The row is then printed on one line: a check killed at a time limit still says, in
    its log, what its finished stages measured."""
    try:
        work()
    except Exception as err:  # noqa: BLE001 - any failure of a stage is reported, and the check goes on
        traceback.print_exc()
        row.status, row.error = FAILED, f"{type(err).__name__}: {one_line(err)}"
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return  # rank 0 says it
    figures = {"tokens/s": row.tokens_per_s and f"{row.tokens_per_s:,.0f}", "MFU": row.mfu and f"{row.mfu:.1%}",
               "peak GiB": row.peak_memory_gib and f"{row.peak_memory_gib:.1f}"}
    print(" | ".join([f"{STAGE_DONE} {row.stage}", row.status + (f": {row.error}" if row.error else "")
                      + " (before the targets are judged)",
                      *(f"{name} {value}" for name, value in figures.items() if value), row.notes]), flush=True)


def unavailable(strategy: str, device: torch.device) -> str | None:
    """Why `strategy` cannot run here, or None."""
    if is_deepspeed(strategy) and device.type != "cuda":
        return f"{strategy} needs CUDA: not run on this CPU (the plain loop stands in for it)"
    if is_deepspeed(strategy) and importlib.util.find_spec("deepspeed") is None:
        return f"{strategy} needs the deepspeed package (pip install -e '.[gpu]')"
    return None


# ---------------------------------------------------------------------------------------------- device memory
def start_peak_memory(device: torch.device) -> None:
    gc.collect()  # the stage before's model and optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def memory_estimate_gib(plan: Plan, loop: PretrainConfig) -> float:
    """The preflight's per-GPU total (model states for the loop's strategy + activations) for this loop."""
    with torch.device("meta"):  # counted, never allocated
        model = NeoBERTForMaskedLM(plan.model_config)
    report = Preflight()
    gpu = torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "cpu"
    return memory_section(report, loop, model, sum(p.numel() for p in model.parameters()), gpu) / GiB


# ---------------------------------------------------------------------------------------------- 1. the ceilings
def encoder_stage(plan: Plan) -> StageRow:
    row = StageRow(ENCODER, "none (one model, no optimizer)")

    def work() -> None:
        start_peak_memory(plan.device)
        row.tokens_per_s, row.mfu = measure_encoder(plan)
        row.peak_memory_gib = peak_memory_gib(plan.device)
        trainer, data = plan.recipe.trainer, plan.recipe.data
        row.notes = (f"encoder forward + backward, no MLM head, {trainer.micro_batch_size} x {data.max_length} "
                     f"tokens, {plan.arithmetic}, median of {plan.config.ceiling_repeats}; for reference: the loops "
                     f"are judged against the row with the MLM head, what they run")

    attempt(row, work)
    return row


def measure_encoder(plan: Plan) -> tuple[float, float | None]:
    """(tokens/s, MFU or None where the device has no published peak) of the recipe's encoder alone, timed by the
    throughput benchmark's step on its full-length batch of micro_batch_size x data.max_length tokens (laid end to
    end with cu_seqlens where the loop is: packing or data.unpad)."""
    recipe, model_config, device = plan.recipe, plan.model_config, plan.device
    torch.manual_seed(recipe.trainer.seed)
    bench = BenchModel("neobert", NeoBERT(model_config), model_config.num_hidden_layers, model_config.hidden_size,
                       model_config.max_length, model_config.vocab_size, model_config.pad_token_id, neobert_forward)
    weights, autocast = plan.ceiling_dtypes
    bench.module.to(device=device, dtype=weights)
    bench.module.set_validate_inputs(False)  # as the loop's module runs it: no host read, every mask applied
    if recipe.model.compile:  # as the loop's module compiles it (its configure_model)
        bench.module.compile(dynamic=False, mode=recipe.model.compile_mode, scope=recipe.model.compile_scope)
        bench.cuda_graphs = recipe.model.compile_mode in CUDA_GRAPH_MODES
    batch = ceiling_batch(plan)
    for _ in range(plan.config.ceiling_warmup):
        time_step(bench, batch, True, device, autocast)
    step = statistics.median(time_step(bench, batch, True, device, autocast)
                             for _ in range(plan.config.ceiling_repeats))
    tokens_per_s = batch.real_tokens / step
    peak = peak_flops(device, plan.ceiling_compute_dtype)
    per_token = bench.batch_flops_per_token(batch, training=True)
    return tokens_per_s, (mfu(tokens_per_s, per_token, peak) if peak else None)


@dataclass
class HeadStep:
    """One training step of the model with its MLM head as the loop takes it, without the optimizer: the pretraining
    module (MLMPretrainingModule: its model, its forward with masked-only logits or not, its FLOP count), a batch
    built by the loop's BatchBuilder and masker, on the device."""

    module: MLMPretrainingModule
    batch: dict
    tokens: int  # real tokens of the batch
    flops_per_token: float  # the module's count (train/mfu's): its matmuls, the decoder as it projects, attention
    device: torch.device
    autocast: torch.dtype | None

    def run(self) -> float:
        """Seconds of forward + MLM loss + backward (under autocast where the loop has it: Plan.ceiling_dtypes)."""
        synchronize(self.device)
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            loss = self.module(self.batch).loss
        loss.backward()
        self.module.zero_grad(set_to_none=True)
        synchronize(self.device)
        return time.perf_counter() - start

    def describe(self) -> str:
        """What the head computes on this batch (one host read: outside the timed steps)."""
        masked = int((self.batch["labels"] != IGNORE_INDEX).sum())
        if self.module.masked_only:
            head = (f"the decoder at the collator's masked_index, {self.batch['masked_index'].numel():,} positions "
                    f"(model.masked_only_logits)")
        else:
            head = f"the decoder at all {self.tokens:,} positions (model.masked_only_logits=false)"
        return f"{head}; {masked:,} of {self.tokens:,} tokens masked"


def head_step(plan: Plan) -> HeadStep:
    """The ceiling batch's token ids (the encoder row's) as documents of data.max_length tokens, through the loop's
    BatchBuilder and masker (its layout: padded, unpadded or packed, static shapes included; masked at masking.rate,
    the rate the module's FLOP count assumes, with a seeded generator), and the module that will run it, compiled
    as its configure_model compiles it (model.compile)."""
    recipe, device = plan.recipe, plan.device
    rows = recipe.trainer.micro_batch_size
    documents = ceiling_batch(plan).input_ids.reshape(rows, -1).tolist()
    masker = MLMMasker.for_pretraining(plan.tokenizer, recipe.masking, recipe.data, rows)
    builder = BatchBuilder(masker, recipe.data.max_length, recipe.data.packing, set(plan.tokenizer.all_special_ids),
                           recipe.data.packing_open_rows, unpad=recipe.data.unpad)
    for ids in documents:
        builder.add(ids)
    builder.flush()
    batch, stats = builder.pop(rows, torch.Generator().manual_seed(recipe.trainer.seed))
    torch.manual_seed(recipe.trainer.seed)
    module = MLMPretrainingModule(recipe, plan.model_config, plan.tokenizer)
    weights, autocast = plan.ceiling_dtypes
    module.to(device=device, dtype=weights).train()
    module.configure_model()
    return HeadStep(module, {key: value.to(device) if isinstance(value, torch.Tensor) else value
                             for key, value in batch.items()},
                    stats["tokens"], module.training_flops_per_token(stats["tokens"], stats["squared_lengths"]),
                    device, autocast)


def head_ceiling_stage(plan: Plan) -> tuple[StageRow, HeadStep | None]:
    """(the row, the step measured: for the profile)."""
    row = StageRow(CEILING, "none (one model, no optimizer)")
    measured = []

    def work() -> None:
        start_peak_memory(plan.device)
        step = head_step(plan)
        for _ in range(plan.config.ceiling_warmup):
            step.run()
        seconds = statistics.median(step.run() for _ in range(plan.config.ceiling_repeats))
        row.tokens_per_s = step.tokens / seconds
        peak = peak_flops(plan.device, plan.ceiling_compute_dtype)
        row.mfu = mfu(row.tokens_per_s, step.flops_per_token, peak) if peak else None
        row.peak_memory_gib = peak_memory_gib(plan.device)
        trainer, data = plan.recipe.trainer, plan.recipe.data
        row.notes = (f"NeoBERTForMaskedLM forward + MLM loss + backward as the pretraining module runs it ("
                     f"{step.describe()}), {trainer.micro_batch_size} x {data.max_length} tokens, {plan.arithmetic}, "
                     f"median of {plan.config.ceiling_repeats}; the loops are judged against this row")
        measured.append(step)

    attempt(row, work)
    return row, (measured[0] if measured else None)


@dataclass(frozen=True)
class ProfileFiles:
    """Where one profiled subject's files go in output_dir: its Chrome trace and its two tables."""

    trace: str
    categories: str
    names: str


CEILING_PROFILE_FILES = ProfileFiles(GPU_CHECK_TRACE, GPU_CHECK_PROFILE_CSV, GPU_CHECK_PROFILE_NAMES_CSV)
LOOP_PROFILE_FILES = ProfileFiles(GPU_CHECK_LOOP_TRACE, GPU_CHECK_LOOP_PROFILE_CSV, GPU_CHECK_LOOP_PROFILE_NAMES_CSV)


def profile_stage(plan: Plan, step: HeadStep | None) -> tuple[StageRow, KernelProfile | None]:
    """`profile_steps` more steps of the ceiling's step under torch.profiler: the Chrome trace, and the self time of
    every CUDA kernel (on a GPU; every CPU operator otherwise) by category, into output_dir."""
    row = StageRow(PROFILE, "none (one model, no optimizer)")
    if step is None:
        row.status, row.notes = SKIPPED, "the ceiling with the MLM head did not run: nothing to profile"
        return row, None
    found = []

    def work() -> None:
        steps = plan.config.profile_steps
        with profile(activities=profiler_activities(plan.device)) as recording:
            wall = sum(step.run() for _ in range(steps))
        result = summarise_recording(recording, plan.device, steps, wall, plan.output_dir, CEILING_PROFILE_FILES,
                                     steps * step.tokens)
        largest = sorted(result.self_us, key=lambda category: -result.self_us[category])[:3]
        row.notes = (f"{steps} step{'s' * (steps != 1)}: {result.source} {result.total_us / 1e3:,.1f} ms, "
                     f"{result.total_us / result.wall_us:.0%} of their wall time; "
                     + ", ".join(f"{category} {result.share(category):.0%}" for category in largest)
                     + f"; {GPU_CHECK_TRACE}, {GPU_CHECK_PROFILE_CSV}, the table below")
        found.append(result)

    attempt(row, work)
    return row, (found[0] if found else None)


def summarise_recording(recording: profile, device: torch.device, steps: int, wall_s: float, output_dir: Path,
                        files: ProfileFiles, tokens: int) -> KernelProfile:
    """A finished torch.profiler recording of `steps` steps that took `wall_s` and trained on `tokens`: its trace and
    tables written to output_dir, its self time by category (and, on a GPU, the device's busy time) returned."""
    output_dir.mkdir(parents=True, exist_ok=True)
    recording.export_chrome_trace(str(output_dir / files.trace))
    result = summarise_events(recording.events(), device.type == "cuda", steps, wall_s * 1e6, tokens)
    if device.type == "cuda":
        result.read_host_waits(output_dir / files.trace)
    write_profile_tables(result, output_dir, files)
    return result


def write_profile_tables(result: KernelProfile, output_dir: Path, files: ProfileFiles) -> None:
    """The self time per category (`files.categories`, every category, their shares summing to 1) and per name,
    with its category (`files.names`: what a new rule of neobert.instruments.kernel_profile would be written from)."""
    write_csv(output_dir / files.categories, ["category", "self_ms", "share", "names", "calls"],
              [[total.category, f"{total.self_us / 1e3:.4f}", f"{total.share:.6f}", total.names, total.calls]
               for total in result.category_totals()])
    write_csv(output_dir / files.names, NAME_COLUMNS, result.name_table())


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    """The csv module's quoting (kernel names hold commas and quotes), written atomically."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([header, *rows])
    write_atomically(path, [text.getvalue()])


def ceiling_batch(plan: Plan) -> Batch:
    data, model_config = plan.recipe.data, plan.model_config
    rows, length = plan.recipe.trainer.micro_batch_size, data.max_length
    batch = make_batch(rows, length, "full", model_config.vocab_size, model_config.pad_token_id, plan.device,
                       plan.recipe.trainer.seed)
    if data.packing == "none" and not data.unpad:  # the loop's padded batches carry a mask, which it always applies
        return dataclasses.replace(batch, attention_mask=torch.ones_like(batch.input_ids))
    return rows_as_documents(batch)  # the loop's layout: cu_seqlens (varlen attention), one document per row


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
