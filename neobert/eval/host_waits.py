"""Where a GPU waited on its host in a profiled step, read from torch.profiler's Chrome trace kernel by kernel.

The device is idle between two stretches of kernels. The idle is the host's when the kernel that ends it was
launched after the device had gone idle (a late launch). It is then blamed on the host operators around that launch
on the launching thread (`cpu_op` and `user_annotation` events): the innermost, such as ``neobert::flash_attn_4_varlen``
or ``aten::mm``, and the outermost, such as ``Torch-Compiled Region: 0/0`` or an autograd node. Otherwise the kernel
was already queued and the idle is the device's own (launch latency, a wait on another stream). Kernels link to their
launch (`cuda_runtime`/`cuda_driver` events: cudaLaunchKernel, cuLaunchKernel for Triton and CuTe DSL, a CUDA graph's
launch) by the trace's `correlation` id.

The same pairing gives each host operator's own time against the device time of the kernels launched inside it: an
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

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
NO_HOST_OP = "(no host operator)"  # a launch outside every recorded operator (Python between operators)
NO_LAUNCH = "(launch not in the trace)"


@dataclass(frozen=True)
class HostWait:
    """Device idle time that ended with kernels launched inside these operators (`innermost` within `outermost`)."""

    innermost: str
    outermost: str
    idle_us: float
    gaps: int


@dataclass(frozen=True)
class OperatorTimes:
    """One host operator (innermost around its launches) over the step: its calls, their host time and the device
    time of the kernels they launched."""

    name: str
    calls: int
    host_us: float
    device_us: float


@dataclass
class HostWaitReport:
    span_us: float  # from the step's first host event to its last kernel's end
    busy_us: float  # the union of the device's kernels, copies and sets
    late_us: float  # idle ended by a late launch: the host's
    queued_us: float  # idle ended by a kernel launched before the idle began: the device's own
    waits: list[HostWait] = field(default_factory=list)  # the host's idle by operator, the largest first
    operators: list[OperatorTimes] = field(default_factory=list)  # by host time over device time, the largest first

    @property
    def idle_us(self) -> float:
        return self.late_us + self.queued_us


def read_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace as torch.profiler writes it (gzip-compressed where the name ends in .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)


def host_waits(trace: dict[str, Any]) -> HostWaitReport | None:
    """The device's idle time in a one-step trace, split into the host's (by operator) and the device's own; None
    where the trace holds no device event (a CPU recording)."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        return None
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    around = _operators_around(events, launches.values())
    host_start = min((e["ts"] for e in events if e.get("cat") in HOST_CATEGORIES | LAUNCH_CATEGORIES),
                     default=device[0]["ts"])
    start = min(host_start, device[0]["ts"])
    end = max(e["ts"] + e["dur"] for e in device)

    busy = late = queued = 0.0
    waits: dict[tuple[str, str], list[float]] = defaultdict(list)
    idle_from = start
    stretch_end = start
    for kernel in device:
        kernel_end = kernel["ts"] + kernel["dur"]
        if kernel["ts"] > stretch_end:  # the device was idle from stretch_end until this kernel
            gap = kernel["ts"] - stretch_end
            launch = launches.get(kernel.get("args", {}).get("correlation"))
            if launch is None:
                late += gap
                waits[(NO_LAUNCH, NO_LAUNCH)].append(gap)
            elif launch["ts"] >= stretch_end:
                late += gap
                inner, outer = around.get(id(launch), (NO_HOST_OP, NO_HOST_OP))
                waits[(inner, outer)].append(gap)
            else:
                queued += gap
            busy += stretch_end - idle_from
            idle_from = kernel["ts"]
        stretch_end = max(stretch_end, kernel_end)
    busy += stretch_end - idle_from

    ranked = sorted((HostWait(inner, outer, sum(gaps), len(gaps)) for (inner, outer), gaps in waits.items()),
                    key=lambda wait: -wait.idle_us)
    return HostWaitReport(end - start, busy, late, queued, ranked, _operator_times(device, launches, around, events))


def _operators_around(events: list[dict], launches) -> dict[int, tuple[str, str]]:
    """For each launch event (by id): the names of the innermost and outermost host operators whose time range holds
    its start on its own thread, found in one sweep per thread (operators nest on a thread)."""
    by_thread: dict[tuple, list[tuple[float, int, float, dict]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            # at one start, the longer (outer) operator first, and operators before launches
            by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 0, -e["dur"], e))
    for e in launches:
        by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 1, 0.0, e))
    found: dict[int, tuple[str, str]] = {}
    for items in by_thread.values():
        items.sort(key=lambda item: item[:3])
        stack: list[dict] = []
        for ts, is_launch, _, e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            if is_launch:
                found[id(e)] = (stack[-1]["name"], stack[0]["name"]) if stack else (NO_HOST_OP, NO_HOST_OP)
            else:
                stack.append(e)
    return found


def _operator_times(device: list[dict], launches: dict, around: dict[int, tuple[str, str]],
                    events: list[dict]) -> list[OperatorTimes]:
    """Per innermost operator around launches: its calls' host time and their kernels' device time."""
    device_us: dict[str, float] = defaultdict(float)
    for kernel in device:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is not None:
            device_us[around.get(id(launch), (NO_HOST_OP,))[0]] += kernel["dur"]
    calls: dict[str, int] = defaultdict(int)
    host_us: dict[str, float] = defaultdict(float)
    launching = set(device_us)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and e["name"] in launching:
            calls[e["name"]] += 1
            host_us[e["name"]] += e["dur"]
    times = [OperatorTimes(name, calls[name], host_us[name], device_us[name]) for name in launching
             if name != NO_HOST_OP]
    return sorted(times, key=lambda op: -(op.host_us - op.device_us))


def host_wait_lines(report: HostWaitReport, shown: int = 5) -> list[str]:
    """A report as Markdown list items: the idle time and its two parts, the host's by operator, and the operators
    whose host time exceeded their kernels' (the `shown` largest of each)."""
    def ms(us: float) -> str:
        return f"{us / 1e3:,.2f} ms"

    lines = [f"- device idle {ms(report.idle_us)} of the step's {ms(report.span_us)} "
             f"({report.idle_us / report.span_us:.0%}; the profiler slows the host): {ms(report.late_us)} waiting "
             f"for a launch, {ms(report.queued_us)} with kernels already queued"]
    if report.waits:
        lines.append("- waiting for a launch, by the operators around it: " + "; ".join(
            f"{w.innermost} (in {w.outermost}) {ms(w.idle_us)} over {w.gaps:,} gaps" for w in report.waits[:shown]))
    slower = [o for o in report.operators if o.host_us > o.device_us][:shown]
    if slower:
        lines.append("- operators whose host time exceeds their kernels': " + "; ".join(
            f"{o.name} {o.calls:,} calls, host {ms(o.host_us)} against kernels {ms(o.device_us)}" for o in slower))
    return lines
