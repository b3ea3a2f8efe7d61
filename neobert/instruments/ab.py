"""Side-by-side timing of interchangeable implementations (the A/B scripts under scripts/bench).

Each variant is a callable that runs one sample and returns its seconds per call (`seconds_per_call`: calls back to
back, so that the device's work is timed, not the host's launches before an idle device; on a GPU with the share of
the sample the host took to issue them, which says when the host set the pace all the same). All are warmed up (twice:
a compiled variant can compile again at its second call, when a guard sees what the first call changed, such as a
cache the compiled code filled), then timed in alternation (A, B, C, A, B, C, ...), so that a change of clock or load
falls on every variant alike, and the median is kept. A variant that raises (an optional kernel library on a GPU it
does not support, a compile error, an error at its n-th call) is left out with the first line of the reason, and the
others are still measured: a candidate cannot cost the run its baseline.
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import time
from functools import partial
from typing import Any, Callable, NamedTuple

import torch

from neobert.instruments.timing import synchronize

CALLS_PER_SAMPLE = 10  # back to back: a sample of a 0.1 ms kernel lasts 1 ms, and the device's queue stays full
# A variant whose host took this share of its sample or more to issue its calls kept the device waiting between them:
# its time is the host's (Python, argument checks, launches), not its kernels'. Under CUDA graphs or inside a bigger
# step the same kernels can run faster than it says.
HOST_BOUND = 0.9


class CallTime(NamedTuple):
    """One sample of `seconds_per_call`: seconds per call, and the share of them the host took to issue the calls (on
    a GPU; None on a CPU, where the host runs the work itself)."""
    seconds: float
    issued_share: float | None


def seconds_per_call(step: Callable[[], Any], device: torch.device, calls: int | None = None) -> CallTime:
    """Seconds per call of `step` (one forward + backward, say), `calls` of them back to back between two waits for
    the device: the host queues the next call while the device runs the last, as in a model's step, so a short
    kernel's sample is not its launch overhead before an idle device, unless issuing a call takes the host longer
    than the device takes to run it (`issued_share` near 1: HOST_BOUND). A step that waits for the device itself (a
    value read on the host, an allocation that waits) reads the same way: its host share is near 1 too."""
    calls = calls or CALLS_PER_SAMPLE  # read at each call: a CPU smoke run of a script sets it to 1
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    issued = time.perf_counter() - start
    synchronize(device)
    elapsed = time.perf_counter() - start
    return CallTime(elapsed / calls, issued / elapsed if device.type == "cuda" else None)


def samples_described(repeats: int) -> str:
    """What a script's header says of its timing: the median of `repeats` samples of CALLS_PER_SAMPLE calls."""
    return f"median of {repeats} samples of {CALLS_PER_SAMPLE} calls"


def reason(err: Exception) -> str:
    """An exception in one line: its type and its message's first line (a compiler's runs over many)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def alternate(variants: dict[str, Callable[[], float | CallTime]], repeats: int,
              warmups: int = 2) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    """(median seconds by variant, why by variant for those that raised, median host share by variant for those
    whose samples are `CallTime`s that have one), in `variants`' order."""
    failed: dict[str, str] = {}
    for name, run in variants.items():  # warm-up: kernels compiled or loaded, the allocator primed
        try:
            for _ in range(warmups):
                run()
        except Exception as err:  # any failure of an optional candidate: reported, never fatal to the others
            failed[name] = reason(err)
    kept = {name: run for name, run in variants.items() if name not in failed}
    times: dict[str, list[float]] = {name: [] for name in kept}
    shares: dict[str, list[float]] = {name: [] for name in kept}
    for repeat in range(repeats):
        for name, run in list(kept.items()):
            try:
                sample = run()
            except Exception as err:  # noqa: BLE001 - as in the warm-up: this variant only
                failed[name] = f"failed at timed sample {repeat + 1}: {reason(err)}"
                del kept[name], times[name], shares[name]
                continue
            if isinstance(sample, CallTime):
                times[name].append(sample.seconds)
                if sample.issued_share is not None:
                    shares[name].append(sample.issued_share)
            else:
                times[name].append(sample)
    return ({name: statistics.median(samples) for name, samples in times.items()}, failed,
            {name: statistics.median(samples) for name, samples in shares.items() if samples})


def compare(variants: dict[str, Any], time_one: Callable[[Any], float | CallTime],
            describe: Callable[[Any, float, float], str], repeats: int, width: int) -> list[str]:
    """One line per variant (the first is the reference): its name padded to `width`, then `describe(variant, its
    median seconds, the reference's)` and, on a GPU, the host's share of the time (`seconds_per_call`), or why it was
    not measured. Raises when the reference itself fails."""
    medians, failed, shares = alternate({name: partial(time_one, variant) for name, variant in variants.items()},
                                        repeats)
    reference = next(iter(variants))
    if reference in failed:
        raise RuntimeError(f"the reference {reference!r} failed: {failed[reference]}")
    lines = [f"  {name:{width}s} not measured: {why}" for name, why in failed.items()]
    for name, median in medians.items():
        try:
            line = f"  {name:{width}s} {describe(variants[name], median, medians[reference])}"
            if name in shares:
                paced = " (the host set the pace)" if shares[name] >= HOST_BOUND else ""
                line += f"; host {shares[name]:.0%}{paced}"
            lines.append(line)
        except Exception as err:  # noqa: BLE001 - its time without its check would be a figure to trust: neither
            lines.append(f"  {name:{width}s} not measured: its check against float32 failed: {reason(err)}")
    return lines


def optional_attribute(module: str, attribute: str) -> tuple[Any | None, str | None]:
    """`module.attribute` of an optional library, a candidate of an A/B script: (it, None), or (None, why) where the
    library is not installed or its import fails (e.g. a GPU library on a machine it does not support)."""
    package = module.split(".")[0]
    if importlib.util.find_spec(package) is None:
        return None, f"{package} is not installed"
    try:
        return getattr(importlib.import_module(module), attribute), None
    except Exception as err:  # any failure of an optional library's import: reported, never fatal to the script
        return None, reason(err)


def device_label(device: torch.device) -> str:
    """The machine an A/B script timed, in its header: the GPU's name, or the CPU and its threads."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
