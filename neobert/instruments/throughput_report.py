"""The throughput measurement's reports: its rows as CSV (written and read back) and as Markdown tables in the
layout of paper Table 9 (tokens/s per model and length, achieved FLOP/s or MFU, and speed ratios); with
profile=true, where each row's step spent its time, by kind of kernel (`write_profile_csvs`, `profile_markdown`)."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from pathlib import Path
from typing import Callable, Sequence

from neobert.config.throughput import LAYOUTS, MODEL_NAMES, MODES
from neobert.errors import ConfigError
from neobert.instruments.encoders import WINDOW_NOTE
from neobert.instruments.host_waits import host_wait_lines
from neobert.instruments.kernel_profile import CATEGORIES, NAME_COLUMNS
from neobert.instruments.timing import ThroughputRow
from neobert.layout import THROUGHPUT_CSV, write_atomically

CSV_FIELDS = [f.name for f in dataclasses.fields(ThroughputRow) if f.name != "profile"]  # the profile has its own
PROFILE_KEYS = ["model", "mode", "layout", "seq_len", "batch_size"]  # which row a profile line belongs to
# the row's fields without a default: a CSV without one of these columns is not the job's
REQUIRED_COLUMNS = {f.name for f in dataclasses.fields(ThroughputRow) if f.default is dataclasses.MISSING}
NUMBER_FIELDS = ("tokens_per_s", "step_s", "flops_per_token", "achieved_flops", "mfu", "peak_flops",
                 "reference_standalone", "issued_share")  # the row's measured or derived floats


def write_csv(rows: Sequence[ThroughputRow], path: str | Path) -> Path:
    """Through `write_atomically`: a run killed while writing (at a time limit) leaves the last whole CSV."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CSV_FIELDS)
    writer.writeheader()
    writer.writerows({name: getattr(row, name) for name in CSV_FIELDS} for row in rows)
    return write_atomically(path, [text.getvalue()])


PROFILE_FAILED = "profile failed"  # how a row's note says that its profile (profile=true) failed, and why


def profiled(rows: Sequence[ThroughputRow]) -> list[ThroughputRow]:
    return [row for row in rows if row.profile is not None]


def profile_failure(row: ThroughputRow) -> str | None:
    """Why the row's profile failed, from its note (None where it did not)."""
    return row.note[row.note.index(PROFILE_FAILED):] if row.profile is None and PROFILE_FAILED in row.note else None


def profile_was_asked(rows: Sequence[ThroughputRow]) -> bool:
    """Whether any row was profiled or failed to be (profile=true): then the profile tables are written."""
    return any(row.profile is not None or profile_failure(row) for row in rows)


def seconds_per_tflop(row: ThroughputRow, self_us: float) -> float:
    """`self_us` of the row's profiled step per TFLOP of the model's work in it (its real tokens x FLOPs per token):
    a category's cost per unit of work, comparable between models of different sizes (a GPU at 100% of a 989 TFLOP/s
    peak spends 1.01 ms per TFLOP in all)."""
    return self_us / 1e6 / (row.profile.tokens * row.flops_per_token / 1e12)


# a profile table's unit of time per TFLOP: the largest that its largest total reaches
TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def write_profile_csvs(rows: Sequence[ThroughputRow], categories_path: str | Path, names_path: str | Path) -> None:
    """Every profiled row's self time per category (every category, shares summing to 1; per step, per 1,000 real
    tokens and per TFLOP) and per kernel or operator name with its category (what a new rule of
    neobert.instruments.kernel_profile would be written from)."""
    with Path(categories_path).open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(PROFILE_KEYS + ["source", "category", "self_ms", "share", "us_per_1k_tokens", "us_per_tflop",
                                        "wall_ms", "device_busy_ms"])
        for row in profiled(rows):
            result = row.profile
            busy = "" if result.busy_us is None else f"{result.busy_us / 1e3:.4f}"
            for total in result.category_totals():
                writer.writerow([getattr(row, key) for key in PROFILE_KEYS] + [
                    result.source, total.category, f"{total.self_us / 1e3:.4f}", f"{total.share:.6f}",
                    f"{total.self_us / result.tokens * 1e3:.4f}", f"{seconds_per_tflop(row, total.self_us) * 1e6:.6g}",
                    f"{result.wall_us / 1e3:.4f}", busy])
    with Path(names_path).open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(PROFILE_KEYS + NAME_COLUMNS)
        for row in profiled(rows):
            keys = [getattr(row, key) for key in PROFILE_KEYS]
            writer.writerows(keys + name for name in row.profile.name_table())


def profile_markdown(rows: Sequence[ThroughputRow]) -> str:
    """Per (mode, layout, length), the profiled models as rows: each category's self time per TFLOP of the model's
    work (its share of the step's kernel time on a GPU, operator time on a CPU), the total, and on a GPU the device's
    busy time over the row's timed step (unprofiled: the profiler's own cost left out; the rest of the step the device
    waited for the host), on a CPU the operators' time over the profiled step. Per FLOP, a category of two models
    compares directly: the ratio of their kernel totals is their per-FLOP ratio where both kept the device busy.
    A timed row whose profile failed is listed below its table with the reason."""
    out = []
    keys = sorted({(r.mode, r.layout, r.seq_len) for r in rows if r.profile is not None or profile_failure(r)},
                  key=lambda k: (MODES.index(k[0]), LAYOUTS.index(k[1]), k[2]))
    for mode, layout, length in keys:
        same = [r for r in rows if (r.mode, r.layout, r.seq_len) == (mode, layout, length)]
        failures = [f"- {r.model}: {profile_failure(r)}" for r in same if profile_failure(r)]
        group = sorted(profiled(same), key=lambda r: MODEL_NAMES.index(r.model))
        if not group:
            out += [f"### where the time goes: {mode}, {layout} batches, {length} tokens\n", *failures, ""]
            continue
        shown = [c for c in CATEGORIES if any(r.profile.self_us[c] for r in group)]
        on_gpu = group[0].profile.busy_us is not None
        largest = max(seconds_per_tflop(r, r.profile.total_us) for r in group)
        scale, unit = next((scale, unit) for scale, unit in TIME_UNITS if largest >= scale or unit == "ns")
        time_of = "kernel" if on_gpu else "operator"
        out += [f"### where the time goes: {mode}, {layout} batches, {length} tokens ({group[0].profile.source}, one "
                f"step)\n",
                f"{unit} per TFLOP of each model's work (share of its {time_of} time); windowed rows count dense "
                f"FLOPs\n",
                "| model (batch) | " + " | ".join(shown)
                + f" | total | {'device busy / timed step' if on_gpu else 'operators / profiled step'} |",
                "|---|" + "---:|" * (len(shown) + 2)]
        for row in group:
            result = row.profile
            cells = [f"{seconds_per_tflop(row, result.self_us[c]) / scale:.3f} ({result.share(c):.0%})" for c in shown]
            covered = result.busy_us / (row.step_s * 1e6) if on_gpu else result.total_us / result.wall_us
            out.append(f"| {row.model} ({row.batch_size}) | " + " | ".join(cells)
                       + f" | {seconds_per_tflop(row, result.total_us) / scale:.3f} | {covered:.0%} |")
        out += [""] + failures + ([""] if failures else [])
    return "\n".join(out)


def host_waits_markdown(rows: Sequence[ThroughputRow]) -> str:
    """Per profiled GPU row, where its device waited in the profiled step (`neobert.instruments.host_waits`). Empty
    where no row has a trace's reading."""
    out = []
    for row in profiled(rows):
        if row.profile.host_waits is not None:
            out += [f"### where the device waited on the host: {row.mode}, {row.layout} batches, {row.seq_len} "
                    f"tokens, {row.model} ({row.batch_size}), the profiled step\n",
                    *host_wait_lines(row.profile.host_waits), ""]
    return "\n".join(out)


def row_problem(row: ThroughputRow) -> str | None:
    """What makes a row one the job never writes (the tables, the plot and the Markdown would break on it), or None:
    a model, mode or layout it does not know, a length, batch size or parameter count below 1, a number that is
    negative or not finite."""
    for name, known in (("model", MODEL_NAMES), ("mode", MODES), ("layout", LAYOUTS)):
        if getattr(row, name) not in known:
            return f"{name} {getattr(row, name)!r} is not one of {', '.join(known)}"
    for name in ("seq_len", "batch_size", "params"):
        if getattr(row, name) is not None and getattr(row, name) < 1:
            return f"{name} {getattr(row, name)} is below 1"
    for name in NUMBER_FIELDS:
        value = getattr(row, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            return f"{name} {value} is not a finite number of at least 0"
    return None


def read_csv(path: str | Path) -> list[ThroughputRow]:
    """The rows of a CSV written by `write_csv` (the notebook's, and `--report`'s re-made reports); columns it does not
    know (a later version's) are left out. A missing file, another kind of CSV, a malformed row or no row: a ConfigError
    naming the file."""
    types = {"batch_size": int, "seq_len": int, "params": int, **{name: float for name in NUMBER_FIELDS}}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"throughput CSV {str(path)!r} does not exist")
    rows = []
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = sorted(REQUIRED_COLUMNS - set(reader.fieldnames or ()))
            if missing:
                raise ConfigError(f"{path}: not the throughput job's CSV ({THROUGHPUT_CSV}): no column "
                                  f"{', '.join(missing)}")
            for number, raw in enumerate(reader, start=2):
                if None in raw or None in raw.values():  # more fields than the header, or fewer (a line cut short)
                    raise ConfigError(f"{path}, line {number}: not a throughput row ({len(raw) - (None in raw)} "
                                      f"columns in the header, a line of another length)")
                try:
                    values = {k: (types[k](v) if v != "" else None) if k in types else v
                              for k, v in raw.items() if k in CSV_FIELDS}
                    rows.append(ThroughputRow(**values))
                except (TypeError, ValueError) as err:
                    raise ConfigError(f"{path}, line {number}: not a throughput row ({err})") from err
                if problem := row_problem(rows[-1]):
                    raise ConfigError(f"{path}, line {number}: not a throughput row: {problem}")
    except (UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(f"{path}: not a readable CSV ({type(err).__name__}: {err})") from err
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value / scale:,.{digits}f}"


def markdown_table(rows: Sequence[ThroughputRow], reference: str = "neobert") -> str:
    """Table 9 layout per (mode, layout): models as rows, lengths as columns, tokens/s (batch size); then the
    achieved FLOP/s, their share of the peak (a GPU's MFU, or on CPU of the matmul rate measured in the same run),
    and the ratio of `reference` to every other model per length."""
    groups = sorted({(r.mode, r.layout) for r in rows}, key=lambda g: (MODES.index(g[0]), LAYOUTS.index(g[1])))
    out = []
    for mode, layout in groups:
        out.extend(_group_tables([r for r in rows if (r.mode, r.layout) == (mode, layout)], reference))
    return "\n".join(out)


def _group_tables(group: Sequence[ThroughputRow], reference: str) -> list[str]:
    """One (mode, layout)'s tables, then every model's notes."""
    mode, layout = group[0].mode, group[0].layout
    lengths = sorted({r.seq_len for r in group if r.seq_len})
    names = [n for n in MODEL_NAMES if any(r.model == n for r in group)]
    cell = {(r.model, r.seq_len): r for r in group}
    out = []

    def section(title: str, models: Sequence[str], text: Callable[[str, int], str], label=lambda n: n) -> None:
        out.extend([f"### {mode}, {layout} batches: {title}\n", "| model | " + " | ".join(map(str, lengths)) + " |",
                    "|---|" + "---:|" * len(lengths)])
        for name in models:
            out.append(f"| {label(name)} | " + " | ".join(text(name, length) for length in lengths) + " |")
        out.append("")

    def measured(model: str, length: int) -> bool:
        return cell.get((model, length)) is not None and cell[(model, length)].tokens_per_s is not None

    def tokens_per_s(name: str, length: int) -> str:
        row = cell.get((name, length))
        return f"{row.tokens_per_s:,.0f} ({row.batch_size})" if measured(name, length) else "n/a"

    def gflops(name: str, length: int) -> str:
        row = cell.get((name, length))
        return _fmt(None if row is None else row.achieved_flops, 1e9, 1)

    def utilisation(name: str, length: int) -> str:
        row = cell.get((name, length))
        return _fmt(None if row is None or row.mfu is None else row.mfu * 100, digits=1)

    def issued(name: str, length: int) -> str:
        row = cell.get((name, length))
        return _fmt(None if row is None or row.issued_share is None else row.issued_share * 100)

    def ratio(name: str, length: int) -> str:
        if not (measured(name, length) and measured(reference, length)):
            return "n/a"
        return _ratio(cell[(reference, length)], cell[(name, length)])

    section("tokens/s (best batch size)", names, tokens_per_s)
    section("achieved GFLOP/s (tokens/s x FLOPs/token from neobert.eval.flops)", names, gflops)
    if peaks := {r.seq_len: r for r in group if r.peak_flops}:
        measured_peak = any(r.peak_source.startswith("measured") for r in peaks.values())
        section("% of the matmul rate measured in this run" if measured_peak else "MFU %", names, utilisation)
        if measured_peak:
            out.extend([_matmul_reference_line(peaks, group[0].dtype), ""])
    if any(r.issued_share is not None for r in group):
        section("the host's time to issue a step, % of the step (well below 100: the kernels set the pace)",
                names, issued)
    others = [n for n in names if n != reference and any(measured(n, x) and measured(reference, x) for x in lengths)]
    if others:
        section(f"ratio {reference} / other (tokens/s; per FLOP)", others, ratio, label=lambda n: f"{reference} / {n}")
    return out + _notes(group)


def _ratio(ours: ThroughputRow, theirs: ThroughputRow) -> str:
    """Speed ratio; per-FLOP ratio, n/a where their FLOPs are counted dense (a windowed row): it would mislead."""
    speed = ours.tokens_per_s / theirs.tokens_per_s
    if WINDOW_NOTE in theirs.note:
        return f"{speed:.2f}x; n/a"
    return f"{speed:.2f}x; {ours.achieved_flops / theirs.achieved_flops:.2f}x"


def _matmul_reference_line(peaks: dict[int, ThroughputRow], dtype: str) -> str:
    """The matmul rate measured between the timed steps, by length, and its check against the standalone rate."""
    rates = ", ".join(f"{n}: {_fmt(r.peak_flops, 1e9, 1)}" for n, r in sorted(peaks.items()))
    first = next(iter(peaks.values()))
    line = f"Matmul reference ({first.peak_source}, {dtype}), GFLOP/s between the timed steps, by length: {rates}"
    if first.reference_standalone:
        off = [n for n, r in peaks.items() if abs(r.peak_flops / r.reference_standalone - 1) > 0.1]
        line += f"; standalone before the models: {_fmt(first.reference_standalone, 1e9, 1)}"
        line += f" (**more than 10% apart at {off}: the machine was not steady**)" if off else ""
    return line


def _notes(group: Sequence[ThroughputRow]) -> list[str]:
    """Every model's notes, once each: why it has no figures, or what it ran (its attention, a windowed row's FLOPs
    counted dense, a NeoBERT row's choices that its name does not say)."""
    notes: dict[str, list[str]] = {}
    for r in group:
        if r.note and r.note not in notes.setdefault(r.model, []):
            notes[r.model].append(r.note)
    lines = [f"- {name}: {note}" for name, model_notes in notes.items() for note in model_notes]
    return lines + [""] if notes else lines
