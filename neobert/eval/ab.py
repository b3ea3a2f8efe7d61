"""Side-by-side timing of interchangeable implementations (the A/B scripts under scripts/bench, run on a GPU lease).

Each variant is a callable that runs one iteration and returns its seconds. All are warmed up (twice: a compiled
variant can compile again at its second call, when a guard sees what the first call changed, such as a cache the
compiled code filled), then timed in alternation (A, B, C, A, B, C, ...), so that a change of clock or load falls on
every variant alike, and the median is kept. A variant whose warm-up raises (an optional kernel library on a GPU it does not support, a compile error)
is left out with the reason, and the others are still measured: a candidate cannot cost a lease its baseline.
"""

from __future__ import annotations

import statistics
from typing import Callable


def alternate(variants: dict[str, Callable[[], float]], repeats: int,
              warmups: int = 2) -> tuple[dict[str, float], dict[str, str]]:
    """(median seconds by variant, why by variant for those whose warm-up raised), in `variants`' order."""
    failed: dict[str, str] = {}
    for name, run in variants.items():  # warm-up: kernels compiled or loaded, the allocator primed
        try:
            for _ in range(warmups):
                run()
        except Exception as err:  # any failure of an optional candidate: reported, never fatal to the others
            failed[name] = f"{type(err).__name__}: {err}"
    kept = {name: run for name, run in variants.items() if name not in failed}
    times: dict[str, list[float]] = {name: [] for name in kept}
    for _ in range(repeats):
        for name, run in kept.items():
            times[name].append(run())
    return {name: statistics.median(samples) for name, samples in times.items()}, failed
