"""Where a GPU waited on its host in a profiled step, read from torch.profiler's Chrome trace kernel by kernel.

The device is idle between two stretches of kernels. The idle is the host's when the kernel that ends it was
launched late: its launch call (`cuda_runtime`/`cuda_driver` events: cudaLaunchKernel, cuLaunchKernel(Ex) for Triton
and CuTe DSL, a CUDA graph's launch, linked to its kernels by the trace's `correlation` id) ended after the device
had gone idle. It is then blamed on the host operators around that launch on the launching thread (`cpu_op` and
`user_annotation` events): the innermost, such as ``neobert::flash_attn_4_varlen`` or a Triton kernel's range, and the
outermost, such as ``Torch-Compiled Region: 0/0`` or an autograd node (wrapper ranges such as Lightning's
``Optimizer.step#AdamW.step``, which holds the whole closure, are passed over). Where the host sat in a blocking
synchronisation (an ``.item()``, a copy to the host) when the device went idle, the idle is blamed on the operators
around that synchronisation instead, marked "after a sync"; the part the profiler's own work held the host (CUPTI's
buffer requests, kineto's `overhead` events), on the profiler. Otherwise the kernel was already queued and the idle
is the device's own (launch latency, a wait on another stream, the gaps inside a CUDA graph's replay).

The same pairing gives each host operator that launched kernels its own host time (its calls' time less their child
operators' and the profiler's work inside it) against the device time of the kernels it launched itself: an
operator whose host time exceeds its kernels' keeps the device waiting wherever the host has no lead to spend.

Host times come from a step run under the profiler, which slows the host (the more operators, the more): they say
which operators keep the device waiting, not by how much an unprofiled step does.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # not gpu_user_annotation: it spans kernels
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
# The host calls that block until the device has caught up
SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2"})
# Ranges that wrap whole phases of a step rather than say what the host did: never the outermost operator
WRAPPER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#", "ProfilerStep#", "[pl]")
NO_HOST_OP = "(no host operator)"  # a launch outside every recorded operator (Python between operators)
NO_LAUNCH = "(launch not in the trace)"
# The profiler's own host work that holds the thread whose call needs it (kineto's "overhead" event of CUPTI's buffer
# requests, which can hold an operator for milliseconds), which an unprofiled step has not. Its other
# overhead events (buffer flushes, driver compiles) are not counted: they carry no thread, and not all block one.
BLOCKING_OVERHEADS = frozenset({"Activity Buffer Request"})
PROFILER = "(the profiler's own work)"
AFTER_SYNC = "after a sync in "


@dataclass(frozen=True)
class HostWait:
    """Device idle time that ended with kernels launched inside these operators (`innermost` within `outermost`)."""

    innermost: str
    outermost: str
    idle_us: float
    gaps: int


@dataclass(frozen=True)
class OperatorTimes:
    """One host operator over the recording, counting its calls that launched kernels themselves: their host time
    (less their child operators') and the device time of the kernels they launched."""

    name: str
    calls: int
    host_us: float
    device_us: float


@dataclass
class HostWaitReport:
    span_us: float  # from the recording's first host event to its last kernel's end
    busy_us: float  # the union of the device's kernels, copies and sets
    late_us: float  # idle ended by a late launch (or following a host sync): the host's
    queued_us: float  # idle ended by a kernel launched before the idle began: the device's own
    waits: list[HostWait] = field(default_factory=list)  # the host's idle by operator, the largest first
    operators: list[OperatorTimes] = field(default_factory=list)  # by host time over device time, the largest first
    unlaunched: int = 0  # device events whose launch is not in the trace (their idle is counted as the host's)
    profiler_us: float = 0.0  # idle while the profiler's own work held the host (BLOCKING_OVERHEADS)
    dropped: int = 0  # device events stamped before the recording's first host event (a clock fault), left out

    @property
    def idle_us(self) -> float:
        return self.late_us + self.profiler_us + self.queued_us


def read_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace as torch.profiler writes it (gzip-compressed where the name ends in .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)


def host_waits(trace: dict[str, Any]) -> HostWaitReport | None:
    """The device's idle time in a recording's trace, split into the host's (by operator) and the device's own; None
    where the trace holds no device event (a CPU recording)."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        return None
    host_starts = [e["ts"] for e in events if e.get("cat") in HOST_CATEGORIES | LAUNCH_CATEGORIES]
    start = min(host_starts) if host_starts else device[0]["ts"]
    kept = [e for e in device if e["ts"] >= start]
    dropped = len(device) - len(kept)
    if not kept:
        return None
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    syncs = sorted((e for e in events if e.get("cat") in LAUNCH_CATEGORIES and e.get("name") in SYNC_CALLS),
                   key=lambda e: e["ts"])
    calls = {id(e): e for e in [*launches.values(), *syncs]}  # a sync with a correlation id is a launch event too
    around, self_us, children = _operators_around(events, list(calls.values()))
    overheads = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e.get("cat") == "overhead" and e.get("name") in BLOCKING_OVERHEADS)
    for e in events:  # an operator's own time leaves out the profiler's work in it (not in its children's time)
        if id(e) in self_us and overheads:
            self_us[id(e)] -= (_overlap(overheads, e["ts"], e["ts"] + e["dur"])
                               - sum(_overlap(overheads, a, b) for a, b in children.get(id(e), ())))

    busy = late = queued = profiler = 0.0
    unlaunched = 0
    waits: dict[tuple[str, str], list[float]] = defaultdict(list)
    device_by_launcher: dict[int, float] = defaultdict(float)  # id of the innermost operator -> its kernels' time
    idle_from = stretch_end = start
    for index, kernel in enumerate(kept):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            unlaunched += 1
        elif id(launch) in around and around[id(launch)][2] is not None:
            device_by_launcher[around[id(launch)][2]] += kernel["dur"]
        if kernel["ts"] > stretch_end:  # the device was idle from stretch_end until this kernel
            gap = kernel["ts"] - stretch_end
            if launch is None:
                late += gap
                waits[(NO_LAUNCH, NO_LAUNCH)].append(gap)
            elif _launched_by(launch) <= stretch_end:  # launched before the device went idle
                queued += gap
            else:
                held = min(gap, _overlap(overheads, stretch_end, kernel["ts"]))
                if held:
                    profiler += held
                    waits[(PROFILER, PROFILER)].append(held)
                if gap > held:
                    late += gap - held
                    sync = _sync_holding(syncs, stretch_end) if index else None
                    if sync is not None and launch["ts"] >= sync["ts"] + sync["dur"]:  # launched once it returned
                        inner, outer, _ = around[id(sync)]
                        waits[(AFTER_SYNC + inner, outer)].append(gap - held)
                    else:
                        inner, outer, _ = around[id(launch)]
                        waits[(inner, outer)].append(gap - held)
            busy += stretch_end - idle_from
            idle_from = kernel["ts"]
        stretch_end = max(stretch_end, kernel["ts"] + kernel["dur"])
    busy += stretch_end - idle_from

    ranked = sorted((HostWait(inner, outer, sum(gaps), len(gaps)) for (inner, outer), gaps in waits.items()),
                    key=lambda wait: -wait.idle_us)
    return HostWaitReport(stretch_end - start, busy, late, queued, ranked,
                          _operator_times(events, device_by_launcher, self_us), unlaunched=unlaunched,
                          profiler_us=profiler, dropped=dropped)


def _launched_by(launch: dict) -> float:
    """When a launch's kernels could start: the end of its call, as a kernel is queued when the call returns; a CUDA
    graph's replay from the call's start (the device runs its kernels while the call, lengthened by the profiler's
    tracing, goes on: the gaps inside a replay are the device's own)."""
    return launch["ts"] if "GraphLaunch" in launch.get("name", "") else launch["ts"] + launch["dur"]


def _overlap(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """How much of [start, end] the (sorted) intervals cover."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals if a < end and b > start)


def _sync_holding(syncs: list[dict], moment: float) -> dict | None:
    """The blocking synchronisation the host was in at `moment` (the device going idle), if any."""
    for sync in syncs:
        if sync["ts"] > moment:
            return None
        if sync["ts"] + sync["dur"] >= moment:
            return sync
    return None


def _operators_around(events: list[dict], calls: list[dict]) -> tuple[dict[int, tuple[str, str, int | None]],
                                                                     dict[int, float], dict[int, list]]:
    """For each host call (a launch or a sync; by id): the names of the innermost and outermost host operators whose
    time range holds its start on its own thread (the outermost passing over wrapper ranges), and the innermost's id;
    every operator's self time (its duration less its direct children's); and each operator's direct children's time
    ranges. One sweep per thread: operators nest on a thread."""
    by_thread: dict[tuple, list[tuple[float, int, float, dict]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            # at one start, operators before calls, and the longer (outer) operator first
            by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 0, -e["dur"], e))
    for e in calls:
        by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 1, 0.0, e))
    found: dict[int, tuple[str, str, int | None]] = {}
    self_us: dict[int, float] = {}
    children: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for items in by_thread.values():
        items.sort(key=lambda item: item[:3])
        stack: list[dict] = []
        for ts, is_call, _, e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:  # ended (one that ends at ts holds nothing)
                stack.pop()
            if is_call:
                if stack:
                    outer = next((op for op in stack if not op["name"].startswith(WRAPPER_PREFIXES)), stack[0])
                    found[id(e)] = (stack[-1]["name"], outer["name"], id(stack[-1]))
                else:
                    found[id(e)] = (NO_HOST_OP, NO_HOST_OP, None)
            else:
                self_us[id(e)] = e["dur"]
                if stack:
                    self_us[id(stack[-1])] -= e["dur"]
                    children[id(stack[-1])].append((e["ts"], e["ts"] + e["dur"]))
                stack.append(e)
    return found, self_us, children


def _operator_times(events: list[dict], device_by_launcher: dict[int, float],
                    self_us: dict[int, float]) -> list[OperatorTimes]:
    """Per operator name, over its calls that launched kernels themselves: their self time and their kernels'."""
    calls: dict[str, int] = defaultdict(int)
    host: dict[str, float] = defaultdict(float)
    device: dict[str, float] = defaultdict(float)
    for e in events:
        if id(e) in device_by_launcher:
            calls[e["name"]] += 1
            host[e["name"]] += self_us[id(e)]
            device[e["name"]] += device_by_launcher[id(e)]
    times = [OperatorTimes(name, calls[name], host[name], device[name]) for name in calls]
    return sorted(times, key=lambda op: -(op.host_us - op.device_us))


def host_wait_lines(report: HostWaitReport, shown: int = 5) -> list[str]:
    """A report as Markdown list items: the idle time and its two parts, the host's by operator, and the operators
    whose host time exceeded their kernels' (the `shown` largest of each)."""
    def ms(us: float) -> str:
        return f"{us / 1e3:,.2f} ms"

    share = f"{report.idle_us / report.span_us:.0%}; " if report.span_us else ""
    lines = [f"- device idle {ms(report.idle_us)} of the recording's {ms(report.span_us)} ({share}the profiler slows "
             f"the host): {ms(report.late_us)} waiting for the host, {ms(report.profiler_us)} for the profiler's own "
             f"work, {ms(report.queued_us)} with kernels already queued"]
    if report.unlaunched or report.dropped:
        lines.append(f"- {report.unlaunched:,} device events without their launch in the trace (their idle counted "
                     f"as the host's), {report.dropped:,} stamped before the recording began (left out)")
    if report.waits:
        lines.append("- waiting for the host, by the operators around the late launch: " + "; ".join(
            f"{w.innermost}{f' (in {w.outermost})' * (w.outermost != w.innermost)} {ms(w.idle_us)} over "
            f"{w.gaps:,} gap{'s' * (w.gaps != 1)}" for w in report.waits[:shown]))
    slower = [o for o in report.operators if o.host_us > o.device_us][:shown]
    if slower:
        lines.append("- operators whose own host time exceeds their kernels': " + "; ".join(
            f"{o.name} {o.calls:,} call{'s' * (o.calls != 1)}, host {ms(o.host_us)} against kernels "
            f"{ms(o.device_us)}" for o in slower))
    return lines
