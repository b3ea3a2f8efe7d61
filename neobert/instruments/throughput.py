"""The throughput job (paper Figure 3 and Table 9; docs/ablations.md): measure every model at every length, then
write throughput.csv, throughput.md (the Table 9 layout) and throughput.png (the Figure 3 layout) under
`output_dir`.

The run (`run_throughput`), with the measurement's pieces from `neobert.instruments.timing`:

* per (model, length), the batch size is searched: the largest candidate that fits (a token budget on CPU, an
  out-of-memory probe on GPU), then the fastest of the largest few that fit;
* repetitions are interleaved across models (A, B, C, A, B, C, ...) and the median is reported, so a shared or
  throttling machine slows every model alike and the ratios stay fair; on a CPU without a published peak, the
  matmul reference is measured between them (MFU's denominator);
* a model that cannot be built or run at a (layout, length) is a row with its reason in `note`; a measured NeoBERT
  row's note names the attention kernel that ran (`neobert` with the auto choice, `neobert-<kernel>` with that one);
* with `profile`, every timed row runs one more step under torch.profiler once every row is timed: where its time
  goes by kind of kernel, in throughput_profile.csv, throughput_profile_names.csv and throughput.md, and each
  step's Chrome trace in throughput_traces/.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Callable, Sequence

import torch

from neobert.config.pretrain import CUDA_GRAPH_MODES
from neobert.config.throughput import FLEX_MODELS, LAYOUTS, ThroughputConfig
from neobert.errors import ConfigError
from neobert.eval.device import resolve_device
from neobert.eval.flops import peak_flops, warn_if_bf16_is_emulated
from neobert.eval.plots import plot_throughput
from neobert.instruments.encoders import (Batch, BenchModel, ModelUnavailable, build_model, graphs_per_shape,
                                          make_batch)
from neobert.instruments.kernel_profile import cuda_graphs_or_error, trace_graphs_captured_from_now
from neobert.instruments.throughput_report import (PROFILE_FAILED, host_waits_markdown, markdown_table,
                                                   profile_markdown, profile_was_asked, read_csv, write_csv,
                                                   write_profile_csvs)
from neobert.instruments.timing import (MATMUL_REFERENCE_SHAPE, MatmulReference, ThroughputRow, is_out_of_memory,
                                        profile_step, resolve_dtype, search_batch_size, time_step)
from neobert.jobs.cli import one_line
from neobert.layout import (THROUGHPUT_CSV, THROUGHPUT_MD, THROUGHPUT_PLOT, THROUGHPUT_PROFILE_CSV,
                            THROUGHPUT_PROFILE_NAMES_CSV, THROUGHPUT_TRACES_DIR)
from neobert.model import NeoBERTConfig
from neobert.model.config import HEAD_FIELDS, PRESETS, ModelFieldError
from neobert.outputs import THROUGHPUT, claim_output_dir, clear_output_dir

log = logging.getLogger(__name__)


def run_throughput_job(config: ThroughputConfig, overwrite: bool = False) -> dict[str, Path]:
    """Measures, writes the reports and returns their paths ({"csv", "markdown", "plot"}, and with profile=true
    "profile", "profile_names" and the folder of the profiled steps' traces, "traces"). Refused before anything is
    measured where output_dir holds an earlier report, unless `overwrite` (`claim_report_dir`)."""
    claim_report_dir(config.output_dir, overwrite)
    rows: list[ThroughputRow] = []

    def write_so_far(done: list[ThroughputRow]) -> None:
        """The tables after each layout and length, and after each profile: a run killed by a time limit leaves
        what it measured. A failure to write them is logged; the run goes on."""
        try:
            write_reports(done, config.output_dir, plot=False, unfinished=True)
        except Exception as err:  # noqa: BLE001 - the end of the run writes them again
            log.warning("the tables so far were not written: %s: %s", type(err).__name__, err)

    try:
        run_throughput(config, rows=rows, on_group=write_so_far)
    except RUN_STOPPERS:
        if rows:  # what was measured before the run stopped: kept, then the error
            write_reports(rows, config.output_dir, unfinished=True)
        raise
    return write_reports(rows, config.output_dir)


REPORT_EXISTS = ("--output-dir {directory} already holds a throughput report ({held}): pass --overwrite to replace "
                 "it, or choose another --output-dir")


def report_from_csvs(csv_paths: Sequence[str | Path], output_dir: str | Path,
                     overwrite: bool = False) -> dict[str, Path]:
    """The reports (CSV, Markdown, the Figure 3 plot) of rows measured earlier, read from throughput CSVs in the order
    given (one per run, e.g. of several machines): no model runs. Profiles are not in a CSV, so their
    tables are not re-made. Refused, before anything is written, where the merged CSV would replace one it reads,
    where a row is not one the job writes (`read_csv`), and where --output-dir holds an earlier report (unless
    `overwrite`, which removes that report's files first: no stale profile table stays beside the new one)."""
    if not csv_paths:
        raise ConfigError("--report needs at least one throughput CSV")
    target = (Path(output_dir) / THROUGHPUT_CSV).resolve()
    if any(Path(path).resolve() == target for path in csv_paths):
        raise ConfigError(f"--output-dir {output_dir}: its {THROUGHPUT_CSV} is one of the CSVs read, which the report "
                          f"would replace; choose another output directory")
    rows = [row for path in csv_paths for row in read_csv(path)]
    claim_report_dir(output_dir, overwrite)
    return write_reports(rows, output_dir)


def claim_report_dir(output_dir: str | Path, overwrite: bool) -> None:
    """Refuses an `output_dir` holding an earlier report unless `overwrite`, which removes that report's files (and
    nothing else): no stale profile table or trace stays beside the new report."""
    claim_output_dir(output_dir, THROUGHPUT, where=f"--output-dir {output_dir}", noun="--output-dir",
                     earlier=REPORT_EXISTS, overwrite=overwrite, flag="--overwrite")
    clear_output_dir(output_dir, THROUGHPUT)


UNFINISHED = "**Written while the run went on: its later rows and profiles are missing where it stopped.**"


def write_reports(rows: Sequence[ThroughputRow], output_dir: str | Path, plot: bool = True,
                  unfinished: bool = False) -> dict[str, Path]:
    """CSV, Markdown table and (`plot`) the Figure 3 plot under `output_dir`; the profiled rows' tables where there
    are any. `unfinished`: the Markdown says so first (what a run killed at a time limit leaves)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(rows, output_dir / THROUGHPUT_CSV)}
    paths["markdown"] = output_dir / THROUGHPUT_MD
    text = markdown_table(rows)
    if profile_was_asked(rows):
        paths["profile"], paths["profile_names"] = (output_dir / THROUGHPUT_PROFILE_CSV,
                                                    output_dir / THROUGHPUT_PROFILE_NAMES_CSV)
        write_profile_csvs(rows, paths["profile"], paths["profile_names"])
        paths["traces"] = output_dir / THROUGHPUT_TRACES_DIR
        text += "\n" + profile_markdown(rows)
        if waits := host_waits_markdown(rows):
            text += "\n" + waits
    paths["markdown"].write_text((UNFINISHED + "\n\n") * unfinished + text + "\n")
    if plot:
        paths["plot"] = plot_throughput(rows, output_dir / THROUGHPUT_PLOT)
    return paths


# ---------------------------------------------------------------------------------------------- the run
def default_lengths(device: torch.device) -> list[int]:
    return [128, 256, 512, 1024, 2048, 4096] if device.type == "cuda" else [128, 512]


def expected_graphs(config: ThroughputConfig, models: Sequence[str], lengths: Sequence[int],
                    candidates: Sequence[int]) -> int:
    """The expected graphs of one code object in this run (an estimate, not dynamo's count), the limit dynamo is given
    (past its own, 8, and 256 for a code object all told, it would fall back to eager without a word, and time that;
    with fail_on_recompile_limit_hit a miscount costs the model that hits it its rows instead). Each model compiles once
    per shape it runs (the searched sizes of every layout and length), and dynamo counts the graphs of one code object
    together: neobert and its neobert-<kernel> rows run the same forward. A FlexAttention row (FLEX_MODELS) compiles
    inside transformers even without compile=true: its block mask and its kernel, each twice a shape (the full and the
    sliding-window mask), and again for grad mode. A compiled FlashAttention 4 row of transformers compiles its
    attention once per layer (graphs_per_shape). Automatic dynamic shapes are off: every shape gets its own static
    graph, as compile=true's dynamic=False gives, not the dynamic graph dynamo would switch to at the second shape
    (which row timed which depended on the search's order)."""
    flex = any(name in FLEX_MODELS for name in models)
    sizes = len(set(candidates)) if config.compile or flex else 1
    shapes = len(config.layouts) * len(lengths) * sizes * (2 if flex else 1) + (4 if flex else 0)
    return shapes * sum(graphs_per_shape(name) if config.compiles(name) else 1 for name in models)


def run_throughput(config: ThroughputConfig, progress: Callable[[str], None] = log.info,
                   rows: list[ThroughputRow] | None = None,
                   on_group: Callable[[list[ThroughputRow]], None] | None = None) -> list[ThroughputRow]:
    """The rows of every model, layout and length (appended to `rows` as they are measured, when given: what a run
    stopped by RUN_STOPPERS measured before it); `on_group(rows)` after each layout and length's rows, and after
    each row's profile."""
    config.validate()
    check_model_overrides(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    emulated_bf16 = warn_if_bf16_is_emulated(device.type, dtype)
    training = config.mode == "training"
    # Training keeps float32 weights and autocasts (what bf16-mixed training does); inference casts the weights.
    weights_dtype = torch.float32 if training else dtype
    autocast_dtype = dtype if training and dtype != torch.float32 else None
    lengths = config.lengths or default_lengths(device)
    candidates = config.batch_sizes or [2 ** i for i in range(11)]
    peak = config.peak_flops or peak_flops(device, dtype)
    peak_source = "given (peak_flops)" if config.peak_flops else "published" if peak else ""
    reference = standalone = None
    if peak is None and device.type == "cpu" and not emulated_bf16:
        reference = MatmulReference(device, dtype, calls=config.matmul_calls)
        # The same measurement alone, before any model exists: what the interleaved one is checked against.
        standalone = statistics.median(reference.measure())
        progress(f"matmul reference, standalone: {standalone / 1e9:,.1f} GFLOP/s")
        peak_source = "measured matmul " + "x".join(map(str, MATMUL_REFERENCE_SHAPE))

    models: dict[str, BenchModel] = {}
    rows = [] if rows is None else rows

    def unavailable(name: str, layout: str, length: int | None, note: str, bench: BenchModel | None = None):
        params = None if bench is None else sum(p.numel() for p in bench.module.parameters())
        rows.append(ThroughputRow(name, config.mode, layout, length or 0, None, None, None, None, None, None, params,
                                  device.type, str(dtype).removeprefix("torch."), note))

    given_up: dict[str, str] = {}  # model -> why its later rows are not run

    def failed(name: str, layout: str, length: int, err: Exception, bench: BenchModel) -> None:
        """A model that built but failed to run at this length: its row says why, the other rows go on. Past dynamo's
        recompile limit, its later rows are not run either: each would compile until the same error."""
        log.warning("%s L=%d %s failed", layout, length, name, exc_info=err)
        why = f"failed: {type(err).__name__}: {one_line(err)}"
        progress(f"{layout} L={length} {name}: {why}")
        if isinstance(err, torch._dynamo.exc.FailOnRecompileLimitHit):
            limits = torch._dynamo.config  # inside the run's patch: the limits it gave
            given_up[name] = (f"not run: past the recompile limit at {layout} L={length} (more graphs of one code "
                              f"object than this run allows: {limits.recompile_limit} at a time, "
                              f"{limits.accumulated_recompile_limit} all told)")
        bench.module.zero_grad(set_to_none=True)  # a training step cut short may have left gradients
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an error the kernel left behind stops the run here (RUN_STOPPERS)
            torch.cuda.empty_cache()
        unavailable(name, layout, length, why, bench)

    torch.manual_seed(config.seed)
    for name in config.models:
        compiled = config.compiles(name)
        try:
            models[name] = build_model(name, device, weights_dtype, config.neobert_preset, config.official_code_dir,
                                       compute_dtype=autocast_dtype or weights_dtype, training=training,
                                       model_overrides=config.model_overrides, compiled=compiled)
        except ModelUnavailable as err:
            progress(f"{name}: not available: {err}")
            for layout in config.layouts:
                for length in lengths:
                    unavailable(name, layout, length, f"not available: {err}")
            continue
        if config.compile and not compiled:  # a reference kept at its best beside the compiled rows
            notes = models[name].attention
            models[name].attention = {layout: "; ".join(filter(None, (notes.get(layout), "eager (eager_models)")))
                                      for layout in LAYOUTS}
        if compiled:
            # One static graph per batch shape, what a deployment of fixed shapes runs. Left to itself, dynamo makes
            # the graph dynamic at the search's second batch size (automatic dynamic shapes), so the timed graph
            # depended on how many sizes the search had tried.
            models[name].module = torch.compile(models[name].module, dynamic=False, mode=config.compile_mode)
            models[name].cuda_graphs = config.compile_mode in CUDA_GRAPH_MODES
    if config.profile and config.compile and config.compile_mode in CUDA_GRAPH_MODES:
        trace_graphs_captured_from_now(device)
    graphs = expected_graphs(config, list(models), lengths, candidates)
    to_profile: list[tuple[ThroughputRow, BenchModel, Batch]] = []  # profile=true: what is profiled after the timing
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, graphs),
                                    accumulated_recompile_limit=max(torch._dynamo.config.accumulated_recompile_limit,
                                                                    graphs),
                                    fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False), \
            cuda_graphs_or_error(device, config.compile_mode):  # "default" unless compile=true (validate)
        for layout in config.layouts:
            for length in lengths:
                chosen: dict[str, tuple[int, Batch]] = {}
                for name, bench in models.items():
                    if name in given_up:
                        unavailable(name, layout, length, given_up[name], bench)
                        continue
                    if length > bench.max_length:
                        unavailable(name, layout, length, f"max length {bench.max_length}", bench)
                        continue
                    if layout in bench.skipped_layouts:
                        unavailable(name, layout, length, bench.skipped_layouts[layout], bench)
                        continue
                    try:
                        best = _search(bench, layout, length, candidates, config, device, training, autocast_dtype)
                    except RUN_STOPPERS:
                        raise
                    except Exception as err:  # noqa: BLE001 - one row's failure, in its note
                        failed(name, layout, length, err, models[name])
                        continue
                    if best is None:
                        unavailable(name, layout, length, "no candidate batch size fits", bench)
                        continue
                    chosen[name] = best
                    progress(f"{layout} L={length} {name}: batch size {best[0]}")
                # Interleaved, timed repetitions: A, B, C, matmul reference, A, B, C, matmul reference, ...
                times: dict[str, list[float]] = {name: [] for name in chosen}
                issued: dict[str, list[float]] = {name: [] for name in chosen}
                reference_rates = []
                for _ in range(config.repeats):
                    for name, (size, batch) in list(chosen.items()):
                        try:
                            times[name].append(time_step(models[name], batch, training, device, autocast_dtype))
                            issued[name].append(models[name].issued_s)
                        except RUN_STOPPERS:
                            raise
                        except Exception as err:  # noqa: BLE001 - one row's failure, in its note
                            failed(name, layout, length, err, models[name])
                            del chosen[name]
                    if reference is not None:
                        reference_rates.extend(reference.measure())
                group_peak = statistics.median(reference_rates) if reference_rates else peak
                if reference_rates:
                    progress(f"{layout} L={length} matmul reference: {group_peak / 1e9:,.1f} GFLOP/s between the steps "
                             f"(median of {len(reference_rates)} calls), {group_peak / standalone:.2f}x standalone")
                for name, (size, batch) in chosen.items():
                    bench = models[name]
                    step = statistics.median(times[name])
                    tokens_per_s = batch.real_tokens / step
                    fpt = bench.batch_flops_per_token(batch, training)
                    achieved = tokens_per_s * fpt
                    rows.append(ThroughputRow(
                        name, config.mode, layout, length, size, tokens_per_s, step, fpt, achieved,
                        None if group_peak is None else achieved / group_peak,
                        sum(p.numel() for p in bench.module.parameters()), device.type,
                        str(dtype).removeprefix("torch."), note=bench.attention.get(layout, ""),
                        peak_flops=group_peak, peak_source=peak_source, reference_standalone=standalone,
                        issued_share=statistics.median(issued[name]) / step if device.type == "cuda" else None,
                    ))
                    progress(f"{layout} L={length} {name}: {tokens_per_s:,.0f} tokens/s (batch {size})")
                    if config.profile:
                        to_profile.append((rows[-1], bench, batch))
                if on_group is not None:
                    on_group(rows)
        # After every timing: a profiler's kernel tracer may stay attached once it has run, and slow what follows
        traces = Path(config.output_dir) / THROUGHPUT_TRACES_DIR
        if to_profile:
            traces.mkdir(parents=True, exist_ok=True)
        for row, bench, batch in to_profile:
            _profile_row(row, bench, batch, training, device, autocast_dtype,
                         traces / f"{row.mode}_{row.layout}_{row.seq_len}_{row.model}.json.gz")
            if on_group is not None:
                on_group(rows)
    return rows


# What stops the whole run rather than one row: an accelerator error (an illegal address, a device-side assert) leaves
# the GPU's context unusable, and every later row would fail for it. Dynamo's recompile limit costs the model that
# hit it its rows (fail_on_recompile_limit_hit: never a row timed in eager): on the H100 (2026-11-26) ModernBERT with
# FA4, compiled, hit it inside transformers' attention and stopped a run whose NeoBERT rows had compiled
RUN_STOPPERS = (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()  # 2.8+


def check_model_overrides(config: ThroughputConfig) -> None:
    """neobert_preset must be a preset, and model_overrides must make a NeoBERTConfig of it whose packages are
    installed: else a ConfigError naming the key, before any work (every NeoBERT row would take them)."""
    if config.neobert_preset not in PRESETS:
        raise ConfigError(f"invalid config key 'neobert_preset': unknown {config.neobert_preset!r}; known presets: "
                          f"{sorted(PRESETS)}")
    if unknown := sorted(set(config.model_overrides) - set(NeoBERTConfig.__dataclass_fields__)):
        raise ConfigError(f"invalid config key 'model_overrides.{unknown[0]}': not a NeoBERTConfig field")
    if heads := [key for key in HEAD_FIELDS if key in config.model_overrides]:
        raise ConfigError(f"invalid config key 'model_overrides.{heads[0]}': a field of the model's heads; the job "
                          f"times the encoder alone")
    try:
        NeoBERTConfig.from_preset(config.neobert_preset, **config.model_overrides)
    except ModelFieldError as err:
        raise err.as_config_error("model_overrides.") from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config key 'model_overrides': {err}") from err


def _profile_row(row: ThroughputRow, bench: BenchModel, batch: Batch, training: bool, device: torch.device,
                 autocast_dtype: torch.dtype | None, trace_path: Path) -> None:
    """Sets `row.profile` from one more step of its model, and writes the step's Chrome trace to `trace_path`; a
    failure, or a GPU recording without a kernel, is said in its note and the log instead: a diagnosis must not cost
    the row its timing."""
    try:
        row.profile = profile_step(bench, batch, training, device, autocast_dtype, trace_path)
        if device.type == "cuda" and not row.profile.total_us:
            row.profile, failure = None, f"{PROFILE_FAILED}: the recording holds no CUDA kernel"
        elif device.type == "cuda" and trace_path.exists():
            row.profile.read_host_waits(trace_path)
    except Exception as err:  # noqa: BLE001 - reported in the row's note and the log
        bench.module.zero_grad(set_to_none=True)  # a training step cut short may have left gradients
        failure = f"{PROFILE_FAILED}: {type(err).__name__}: {err}"
    if row.profile is None:
        row.note = "; ".join(filter(None, (row.note, failure)))
        log.warning("%s L=%d %s: %s", row.layout, row.seq_len, row.model, failure)


def _search(bench: BenchModel, layout: str, length: int, candidates: Sequence[int], config: ThroughputConfig,
            device: torch.device, training: bool, autocast_dtype: torch.dtype | None) -> tuple[int, Batch] | None:
    batches: dict[int, Batch] = {}

    def batch_of(size: int) -> Batch:
        if size not in batches:
            batches[size] = make_batch(size, length, layout, bench.vocab_size, bench.pad_token_id, device, config.seed,
                                       config.length_distribution)
        return batches[size]

    def out_of_memory(size: int, err: BaseException) -> None:
        """Raises `err` unless it says the device ran out of memory; else drops the size's batch and its memory."""
        if not is_out_of_memory(err):
            raise err
        batches.pop(size, None)
        bench.module.zero_grad(set_to_none=True)  # a training step cut short may have left gradients
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def fits(size: int) -> bool:
        if device.type != "cuda":
            return config.max_tokens <= 0 or size * length <= config.max_tokens
        try:
            time_step(bench, batch_of(size), training, device, autocast_dtype)
            return True
        except (torch.OutOfMemoryError, RuntimeError) as err:
            out_of_memory(size, err)
            return False

    def throughput(size: int) -> float | None:
        """Tokens/s of one timed step after the warm-up; None where the device ran out of memory (under CUDA graphs
        a size records its graphs here, after `fits`' one step)."""
        batch = batch_of(size)
        try:
            for _ in range(config.warmup):
                time_step(bench, batch, training, device, autocast_dtype)
            return batch.real_tokens / time_step(bench, batch, training, device, autocast_dtype)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            out_of_memory(size, err)
            return None

    if len(set(candidates)) == 1:  # a batch size the user fixed: no search and no CPU budget, just warm up
        size = candidates[0]
        if device.type == "cuda" and not fits(size):
            return None
        for _ in range(config.warmup):
            time_step(bench, batch_of(size), training, device, autocast_dtype)
        return size, batch_of(size)
    best, _, speeds = search_batch_size(candidates, fits, throughput, config.search_top)
    if best is None:
        return None
    log.info("%s L=%d %s: tokens/s by batch size in the search (one step each): %s; kept %d", layout, length,
             bench.name, ", ".join(f"{size}: {speed:,.0f}" for size, speed in speeds.items()), best)
    for size in list(batches):
        if size != best:
            del batches[size]
    return best, batch_of(best)
