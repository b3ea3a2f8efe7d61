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

import dataclasses
import logging
import statistics
from pathlib import Path
from typing import Callable, Sequence

import torch

from neobert.config.pretrain import CUDA_GRAPH_MODES
from neobert.config.throughput import LAYOUTS, ThroughputConfig
from neobert.errors import ConfigError
from neobert.eval.device import resolve_device
from neobert.eval.flops import peak_flops, warn_if_bf16_is_emulated
from neobert.eval.plots import plot_throughput
from neobert.instruments.encoders import Batch, BenchModel, ModelUnavailable, build_model, make_batch
from neobert.instruments.kernel_profile import cuda_graphs_or_error, trace_graphs_captured_from_now
from neobert.instruments.throughput_plan import (check_model_overrides, default_lengths, expected_graphs,
                                                 recompile_limits)
from neobert.instruments.throughput_report import (PROFILE_FAILED, host_waits_markdown, markdown_table,
                                                   profile_markdown, profile_was_asked, read_csv, write_csv,
                                                   write_profile_csvs)
from neobert.instruments.timing import (MATMUL_REFERENCE_SHAPE, MatmulReference, ThroughputRow, is_out_of_memory,
                                        profile_step, resolve_dtype, search_batch_size, time_step)
from neobert.jobs.cli import one_line
from neobert.layout import (THROUGHPUT_CSV, THROUGHPUT_MD, THROUGHPUT_PLOT, THROUGHPUT_PROFILE_CSV,
                            THROUGHPUT_PROFILE_NAMES_CSV, THROUGHPUT_TRACES_DIR)
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
def run_throughput(config: ThroughputConfig, progress: Callable[[str], None] = log.info,
                   rows: list[ThroughputRow] | None = None,
                   on_group: Callable[[list[ThroughputRow]], None] | None = None) -> list[ThroughputRow]:
    """The rows of every model, layout and length (appended to `rows` as they are measured, when given: what a run
    stopped by RUN_STOPPERS measured before it); `on_group(rows)` after each layout and length's rows, and after
    each row's profile."""
    config.validate()
    check_model_overrides(config)
    run = _start_run(config, progress, [] if rows is None else rows)
    models = _build_models(run)
    if config.profile and config.compile and config.compile_mode in CUDA_GRAPH_MODES:
        trace_graphs_captured_from_now(run.device)
    graphs = expected_graphs(config, list(models), run.lengths, run.candidates)
    to_profile: list[tuple[ThroughputRow, BenchModel, Batch]] = []  # profile=true: what is profiled after the timing
    # compile_mode is "default" unless compile=true (validate)
    with recompile_limits(graphs), cuda_graphs_or_error(run.device, config.compile_mode):
        for layout in config.layouts:
            for length in run.lengths:
                timed = _measure_group(run, models, layout, length)
                if config.profile:
                    to_profile.extend(timed)
                if on_group is not None:
                    on_group(run.rows)
        _profile_rows(run, to_profile, on_group)
    return run.rows


@dataclasses.dataclass
class Run:
    """What every step of a run shares: its config, its device and dtypes, MFU's denominator, and its rows so far."""

    config: ThroughputConfig
    progress: Callable[[str], None]
    rows: list[ThroughputRow]
    device: torch.device
    dtype: torch.dtype
    lengths: list[int]
    candidates: list[int]  # the batch sizes searched
    peak: float | None  # a published or given peak FLOP/s
    peak_source: str
    reference: MatmulReference | None = None  # on a CPU without a published peak: measured between the steps
    standalone: float | None = None  # the reference alone, before any model exists
    given_up: dict[str, str] = dataclasses.field(default_factory=dict)  # model -> why its later rows are not run

    @property
    def training(self) -> bool:
        return self.config.mode == "training"

    @property
    def weights_dtype(self) -> torch.dtype:
        # Training keeps float32 weights and autocasts (what bf16-mixed training does); inference casts the weights.
        return torch.float32 if self.training else self.dtype

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.dtype if self.training and self.dtype != torch.float32 else None

    def unavailable(self, name: str, layout: str, length: int | None, note: str, bench: BenchModel | None = None):
        params = None if bench is None else sum(p.numel() for p in bench.module.parameters())
        self.rows.append(ThroughputRow(name, self.config.mode, layout, length or 0, None, None, None, None, None, None,
                                       params, self.device.type, str(self.dtype).removeprefix("torch."), note))

    def failed(self, name: str, layout: str, length: int, err: Exception, bench: BenchModel) -> None:
        """A model that built but failed to run at this length: its row says why, the other rows go on. Past dynamo's
        recompile limit, its later rows are not run either: each would compile until the same error."""
        log.warning("%s L=%d %s failed", layout, length, name, exc_info=err)
        why = f"failed: {type(err).__name__}: {one_line(err)}"
        self.progress(f"{layout} L={length} {name}: {why}")
        if isinstance(err, torch._dynamo.exc.FailOnRecompileLimitHit):
            limits = torch._dynamo.config  # inside the run's patch: the limits it gave
            self.given_up[name] = (f"not run: past the recompile limit at {layout} L={length} (more graphs of one "
                                   f"code object than this run allows: {limits.recompile_limit} at a time, "
                                   f"{limits.accumulated_recompile_limit} all told)")
        bench.module.zero_grad(set_to_none=True)  # a training step cut short may have left gradients
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # an error the kernel left behind stops the run here (RUN_STOPPERS)
            torch.cuda.empty_cache()
        self.unavailable(name, layout, length, why, bench)


def _start_run(config: ThroughputConfig, progress: Callable[[str], None], rows: list[ThroughputRow]) -> Run:
    """Threads, device, dtype and MFU's denominator: a given or published peak, else on a CPU (bf16 not emulated)
    the matmul reference, measured alone first."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    emulated_bf16 = warn_if_bf16_is_emulated(device.type, dtype)
    peak = config.peak_flops or peak_flops(device, dtype)
    run = Run(config, progress, rows, device, dtype, lengths=config.lengths or default_lengths(device),
              candidates=config.batch_sizes or [2 ** i for i in range(11)], peak=peak,
              peak_source="given (peak_flops)" if config.peak_flops else "published" if peak else "")
    if peak is None and device.type == "cpu" and not emulated_bf16:
        run.reference = MatmulReference(device, dtype, calls=config.matmul_calls)
        # The same measurement alone, before any model exists: what the interleaved one is checked against.
        run.standalone = statistics.median(run.reference.measure())
        progress(f"matmul reference, standalone: {run.standalone / 1e9:,.1f} GFLOP/s")
        run.peak_source = "measured matmul " + "x".join(map(str, MATMUL_REFERENCE_SHAPE))
    return run


def _build_models(run: Run) -> dict[str, BenchModel]:
    """Every model that builds, compiled where the config says; one that cannot has a row per layout and length
    saying why."""
    config, models = run.config, {}
    torch.manual_seed(config.seed)
    for name in config.models:
        compiled = config.compiles(name)
        try:
            models[name] = build_model(name, run.device, run.weights_dtype, config.neobert_preset,
                                       config.official_code_dir, compute_dtype=run.autocast_dtype or run.weights_dtype,
                                       training=run.training, model_overrides=config.model_overrides,
                                       compiled=compiled)
        except ModelUnavailable as err:
            run.progress(f"{name}: not available: {err}")
            for layout in config.layouts:
                for length in run.lengths:
                    run.unavailable(name, layout, length, f"not available: {err}")
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
    return models


def _measure_group(run: Run, models: dict[str, BenchModel], layout: str,
                   length: int) -> list[tuple[ThroughputRow, BenchModel, Batch]]:
    """Every model's row at one layout and length: its batch size searched, then its steps timed, interleaved with
    the other models'. Returns the timed rows, each with its model and batch (what profiles it)."""
    chosen = _choose_batches(run, models, layout, length)
    times, issued, peak = _time_interleaved(run, models, layout, length, chosen)
    timed = []
    for name, (size, batch) in chosen.items():
        bench = models[name]
        step = statistics.median(times[name])
        tokens_per_s = batch.real_tokens / step
        fpt = bench.batch_flops_per_token(batch, run.training)
        achieved = tokens_per_s * fpt
        run.rows.append(ThroughputRow(
            name, run.config.mode, layout, length, size, tokens_per_s, step, fpt, achieved,
            None if peak is None else achieved / peak, sum(p.numel() for p in bench.module.parameters()),
            run.device.type, str(run.dtype).removeprefix("torch."), note=bench.attention.get(layout, ""),
            peak_flops=peak, peak_source=run.peak_source, reference_standalone=run.standalone,
            issued_share=statistics.median(issued[name]) / step if run.device.type == "cuda" else None,
        ))
        run.progress(f"{layout} L={length} {name}: {tokens_per_s:,.0f} tokens/s (batch {size})")
        timed.append((run.rows[-1], bench, batch))
    return timed


def _choose_batches(run: Run, models: dict[str, BenchModel], layout: str,
                    length: int) -> dict[str, tuple[int, Batch]]:
    """Each model's batch size and batch at this layout and length (`_search`); a model that cannot run here has a
    row saying why instead."""
    chosen = {}
    for name, bench in models.items():
        if (why := _why_not_run(run, name, bench, layout, length)) is not None:
            run.unavailable(name, layout, length, why, bench)
            continue
        try:
            best = _search(bench, layout, length, run.candidates, run.config, run.device, run.training,
                           run.autocast_dtype)
        except RUN_STOPPERS:
            raise
        except Exception as err:  # noqa: BLE001 - one row's failure, in its note
            run.failed(name, layout, length, err, bench)
            continue
        if best is None:
            run.unavailable(name, layout, length, "no candidate batch size fits", bench)
            continue
        chosen[name] = best
        run.progress(f"{layout} L={length} {name}: batch size {best[0]}")
    return chosen


def _why_not_run(run: Run, name: str, bench: BenchModel, layout: str, length: int) -> str | None:
    if name in run.given_up:
        return run.given_up[name]
    if length > bench.max_length:
        return f"max length {bench.max_length}"
    return bench.skipped_layouts[layout] if layout in bench.skipped_layouts else None


def _time_interleaved(run: Run, models: dict[str, BenchModel], layout: str, length: int,
                      chosen: dict[str, tuple[int, Batch]]) -> tuple[dict[str, list[float]], dict[str, list[float]],
                                                                     float | None]:
    """Timed repetitions, interleaved: A, B, C, matmul reference, A, B, C, matmul reference, ... Returns each
    model's step times and the host's time issuing them, and the peak its MFU is a share of. A model that fails
    leaves `chosen`, with a row saying why."""
    times: dict[str, list[float]] = {name: [] for name in chosen}
    issued: dict[str, list[float]] = {name: [] for name in chosen}
    reference_rates = []
    for _ in range(run.config.repeats):
        for name, (size, batch) in list(chosen.items()):
            try:
                times[name].append(time_step(models[name], batch, run.training, run.device, run.autocast_dtype))
                issued[name].append(models[name].issued_s)
            except RUN_STOPPERS:
                raise
            except Exception as err:  # noqa: BLE001 - one row's failure, in its note
                run.failed(name, layout, length, err, models[name])
                del chosen[name]
        if run.reference is not None:
            reference_rates.extend(run.reference.measure())
    if not reference_rates:
        return times, issued, run.peak
    peak = statistics.median(reference_rates)
    run.progress(f"{layout} L={length} matmul reference: {peak / 1e9:,.1f} GFLOP/s between the steps (median of "
                 f"{len(reference_rates)} calls), {peak / run.standalone:.2f}x standalone")
    return times, issued, peak


def _profile_rows(run: Run, to_profile: Sequence[tuple[ThroughputRow, BenchModel, Batch]],
                  on_group: Callable[[list[ThroughputRow]], None] | None) -> None:
    """One more step of each timed row under torch.profiler (`_profile_row`), its trace in throughput_traces/. After
    every timing: a profiler's kernel tracer may stay attached once it has run, and slow what follows."""
    traces = Path(run.config.output_dir) / THROUGHPUT_TRACES_DIR
    if to_profile:
        traces.mkdir(parents=True, exist_ok=True)
    for row, bench, batch in to_profile:
        _profile_row(row, bench, batch, run.training, run.device, run.autocast_dtype,
                     traces / f"{row.mode}_{row.layout}_{row.seq_len}_{row.model}.json.gz")
        if on_group is not None:
            on_group(run.rows)


# What stops the whole run rather than one row: an accelerator error (an illegal address, a device-side assert) leaves
# the GPU's context unusable, and every later row would fail for it. Dynamo's recompile limit costs the model that
# hit it its rows (fail_on_recompile_limit_hit: never a row timed in eager): on the H100 (2026-11-26) ModernBERT with
# FA4, compiled, hit it inside transformers' attention and stopped a run whose NeoBERT rows had compiled
RUN_STOPPERS = (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()  # 2.8+


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
