"""What the training data does differently as training goes on: the micro-batch size during a batch-size warm-up
and the masking rate of a `masking.rate_schedule`.

Both are functions of the optimizer step a micro-batch belongs to, and a stream knows that step from its own
batch count alone (see `DataSchedule.step_of`, `neobert.data.stream_layout`), so a resumed run builds the very batches an uninterrupted one
would, mid-ramp included, without asking the Trainer.
"""

from __future__ import annotations

import bisect
from typing import Sequence


def piecewise_linear(points: Sequence[Sequence[float]], step: int, default: float) -> float:
    """The value at `step` of the curve through `points` ([[step, value], ...], steps non-decreasing): linear
    between points, constant before the first and after the last; of points sharing a step, the last one holds
    from that step on (a jump). No points: `default`."""
    if not points:
        return default
    steps = [p[0] for p in points]
    after = bisect.bisect_right(steps, step)  # points[after - 1] is the last point at or before `step`
    if after == 0:
        return float(points[0][1])
    if after == len(points):
        return float(points[-1][1])
    (x0, y0), (x1, y1) = points[after - 1], points[after]
    return float(y0 + (y1 - y0) * (step - x0) / (x1 - x0))


class DataSchedule:
    """The micro-batch size and masking rate of every optimizer step of a run.

    Batch-size warm-up (`start_batch_size` sequences, all devices, growing to the full batch over
    `warmup_tokens`): the global batch of a step is start + (full - start) x tokens_before / warmup_tokens, where
    tokens_before counts the sequences of the earlier steps at `sequence_length` tokens each (the row length, so
    exact for packed rows and an upper bound for padded ones); the micro-batch is that batch divided by
    accumulation x devices, rounded down, at least 1. The accumulation count stays fixed, so every step has the
    same number of micro-batches on every device, as Lightning expects.
    """

    def __init__(self, micro_batch_size: int, accumulate: int = 1, world_size: int = 1, *,
                 start_batch_size: int = 0, warmup_tokens: int = 0, sequence_length: int = 1,
                 mask_rate: float = 0.2, mask_rate_schedule: Sequence[Sequence[float]] = (), first_step: int = 0):
        self.micro_batch_size, self.accumulate, self.world_size = micro_batch_size, accumulate, world_size
        self.first_step = first_step  # the optimizer step of the stream's first batch (a phase's first step)
        self.mask_rate_default, self.mask_rate_schedule = mask_rate, [list(p) for p in mask_rate_schedule]
        self.sequences_per_micro_row = accumulate * world_size  # global sequences per unit of micro-batch size
        self.start_micro = max(1, start_batch_size // self.sequences_per_micro_row) if start_batch_size else None
        self.warmup_tokens, self.sequence_length = warmup_tokens, sequence_length
        self._ramp: list[int] = []  # micro-batch size of steps 0, 1, ... until the ramp reaches the full size
        self._ramp_tokens = 0  # tokens of the steps in _ramp

    @classmethod
    def from_config(cls, trainer, masking, sequence_length: int, world_size: int = 1,
                    first_step: int = 0) -> "DataSchedule":
        """`trainer`: pretraining's trainer section (micro-batch, accumulation, batch_size_warmup); `first_step`:
        the step the streams start at (a later phase's first step; its streams count batches from there)."""
        warmup = trainer.batch_size_warmup
        return cls(trainer.micro_batch_size, trainer.accumulate_grad_batches, world_size,
                   start_batch_size=warmup.start_batch_size, warmup_tokens=warmup.tokens,
                   sequence_length=sequence_length,
                   mask_rate=masking.rate, mask_rate_schedule=masking.rate_schedule, first_step=first_step)

    def step_of(self, micro_batch_index: int) -> int:
        """The optimizer step of the run's `micro_batch_index`-th micro-batch (0-based, all ranks together:
        `neobert.data.stream_layout`) since `first_step`."""
        return self.first_step + micro_batch_index // (self.accumulate * self.world_size)

    def batch_size(self, step: int) -> int:
        """Micro-batch size (sequences per device per forward) at optimizer step `step`."""
        if self.start_micro is None or self.start_micro >= self.micro_batch_size:
            return self.micro_batch_size
        per_unit = self.sequences_per_micro_row
        start, full = self.start_micro * per_unit, self.micro_batch_size * per_unit
        while len(self._ramp) <= step and (not self._ramp or self._ramp[-1] < self.micro_batch_size):
            wanted = start + (full - start) * min(1.0, self._ramp_tokens / self.warmup_tokens)
            size = max(1, min(self.micro_batch_size, int(wanted) // per_unit))
            self._ramp.append(size)
            self._ramp_tokens += size * per_unit * self.sequence_length
        return self._ramp[step] if step < len(self._ramp) else self.micro_batch_size

    def mask_rate(self, step: int) -> float:
        return piecewise_linear(self.mask_rate_schedule, step, self.mask_rate_default)
