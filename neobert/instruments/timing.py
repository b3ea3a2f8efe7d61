"""Encoder throughput (tokens/s) against sequence length, the measurement (paper Figure 3 and Table 9, any
machine): one timed or profiled step of an encoder of `neobert.instruments.encoders`, the batch-size search (the
largest candidate that fits: a token budget on CPU, an out-of-memory probe on GPU, then the fastest of the largest
few that fit), the CPU's matmul reference and a measured row. The run over models, layouts and lengths is
`neobert.instruments.throughput.run_throughput`.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from neobert.instruments.encoders import Batch, BenchModel
from neobert.instruments.kernel_profile import KernelProfile, profiler_activities, summarise_events

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op off CUDA): what a timer reads before and after a step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(model: BenchModel, batch: Batch, training: bool, device: torch.device,
              autocast_dtype: torch.dtype | None = None) -> float:
    """Seconds for one inference forward, or one training step (forward + backward of a scalar loss, under
    autocast to `autocast_dtype` when one is given: mixed precision). The seconds the host took to issue it (all but
    the final wait for the device) are left in `model.issued_s`: on a GPU, well below the step's own the host was
    ahead; near it, the host set the pace or a launch blocked (a full launch queue, an allocation that waited)."""
    synchronize(device)
    start = time.perf_counter()
    if model.cuda_graphs:  # the graphs may reuse the last call's output memory: that step is over
        torch.compiler.cudagraph_mark_step_begin()
    if training:
        model.module.train()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            hidden = model.forward(model.module, batch)
        hidden.float().square().mean().backward()
        model.module.zero_grad(set_to_none=True)
    else:
        model.module.eval()
        with torch.inference_mode():
            model.forward(model.module, batch)
    model.issued_s = time.perf_counter() - start
    synchronize(device)
    return time.perf_counter() - start


def profile_step(model: BenchModel, batch: Batch, training: bool, device: torch.device,
                 autocast_dtype: torch.dtype | None = None, trace_path: str | Path | None = None) -> KernelProfile:
    """One more `time_step` under torch.profiler: where its time went, by kind of kernel (on a GPU; the CPU's
    operators otherwise), and on a GPU how much of the step's wall time the device was busy (the rest it waited for
    the host: launches, Python). Called after a row's timed steps: the profiler's overhead is in no timing.
    `trace_path`: the step's Chrome trace written there too (gzip-compressed where it ends in .gz), for when the
    device waits: the gaps between its kernels, and what the host ran meanwhile."""
    with profile(activities=profiler_activities(device)) as recording:
        wall = time_step(model, batch, training, device, autocast_dtype)
    summary = summarise_events(recording.events(), device.type == "cuda", 1, wall * 1e6, batch.real_tokens)
    if trace_path is not None:
        try:
            recording.export_chrome_trace(str(trace_path))
        except Exception as err:  # noqa: BLE001 - the trace is a help to the summary, whose figures stand without it
            log.warning("the profiled step's trace was not written to %s: %s", trace_path, err)
    return summary


# The reference matmul of a CPU's rate: the shape of a 768-wide encoder's FFN input projection on 4,096 tokens.
MATMUL_REFERENCE_SHAPE = (4096, 768, 3072)


class MatmulReference:
    """What one plain matmul reaches on this device in `dtype`: the ceiling an encoder's FLOP/s is compared with
    where no peak is published (CPUs). Warmed up, then every `measure()` times `calls` matmuls into one preallocated
    output (a fresh 4096x3072 output per call would time the allocator's page faults, not the matmul). The caller
    interleaves `measure()` with the timed model steps, in the models' threads and compute dtype, so that the
    reference shares their conditions (load, clock), and takes the median of all the calls."""

    def __init__(self, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] = MATMUL_REFERENCE_SHAPE,
                 calls: int = 20, warmup: int = 3):
        m, k, n = shape
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
        self.b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
        self.out = torch.empty(m, n, device=device, dtype=dtype)
        self.flops = 2 * m * k * n
        self.device = device
        self.calls = calls
        for _ in range(warmup):  # the first calls allocate, pick kernels and fault the pages in
            torch.mm(self.a, self.b, out=self.out)

    def measure(self) -> list[float]:
        """FLOP/s of each of `calls` matmuls."""
        rates = []
        for _ in range(self.calls):
            synchronize(self.device)
            start = time.perf_counter()
            torch.mm(self.a, self.b, out=self.out)
            synchronize(self.device)
            rates.append(self.flops / (time.perf_counter() - start))
        return rates


@dataclass
class DtypeConversions:
    count: int  # tensors converted to another dtype (`aten::_to_copy` events), composite ops' own included
    elements: int  # the elements those conversions wrote


def dtype_conversions(call: Callable[[], object]) -> DtypeConversions:
    """The dtype conversions of one `call()` under inference mode, from the profiler's op events, which include what
    composite ops do inside (nn.RMSNorm's float32 round trip happens inside `rms_norm`: a Python dispatch mode sees
    one op there). A count that does not depend on the machine: what the bf16 fast path is held to."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    copies = [event for event in prof.events() if event.name == "aten::_to_copy"]
    return DtypeConversions(len(copies), sum(math.prod(event.input_shapes[0]) for event in copies))


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def search_batch_size(candidates: Sequence[int], fits: Callable[[int], bool],
                      throughput: Callable[[int], float | None], top: int = 3) -> tuple[int | None, int | None, dict]:
    """Returns (fastest batch size, largest that fits, {batch size: tokens/s}).

    `fits` is probed from the smallest candidate up and the search stops at the first that does not fit
    (memory grows with the batch); then the `top` largest fitting sizes are timed and the fastest wins. A size whose
    timing gives None ran out of memory there (CUDA graphs are recorded after the probe's one step, and keep the
    smaller sizes' memory): it is left out, as are the larger ones."""
    fitting = []
    for size in sorted(set(candidates)):
        if not fits(size):
            break
        fitting.append(size)
    speeds = {}
    for size in fitting[-top:]:
        speed = throughput(size)
        if speed is None:
            fitting = [kept for kept in fitting if kept < size]
            break
        speeds[size] = speed
    if not speeds:
        return None, fitting[-1] if fitting else None, {}
    best = max(speeds, key=lambda size: speeds[size])
    return best, fitting[-1], speeds


# ---------------------------------------------------------------------------------------------- rows, devices
@dataclass
class ThroughputRow:
    model: str
    mode: str
    layout: str
    seq_len: int
    batch_size: int | None
    tokens_per_s: float | None
    step_s: float | None
    flops_per_token: float | None
    achieved_flops: float | None
    mfu: float | None
    params: int | None
    device: str
    dtype: str
    note: str = ""
    peak_flops: float | None = None  # MFU's denominator: a GPU's published peak, or the CPU matmul rate measured
    peak_source: str = ""  # "published" | "given (peak_flops)" | "measured matmul MxKxN" | ""
    reference_standalone: float | None = None  # the measured matmul rate alone, before the models (its check)
    # On a GPU: the host's time to issue a timed step, over the step's (medians): well below 1 the host was ahead;
    # near 1 it set the pace, or a launch blocked; None on a CPU, where the host runs the work itself
    issued_share: float | None = None
    # profile=true: one more step of the row under torch.profiler (`profile_step`); reported in its own tables, not
    # in throughput.csv
    profile: KernelProfile | None = field(default=None, repr=False, compare=False)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
