"""Where a training step's time goes, by kind of work: the self time of each kernel (on a GPU) or operator (on a
CPU) of a `torch.profiler` recording, put into categories by name (`category_of`, the explicit patterns of
`RULES`) and summed (`summarise`, `summarise_events`). The GPU check's profiles of the model with its MLM head and of
the training loop use it (`neobert.instruments.gpu_check_stages` and `gpu_check_loops`, `profile=true`), and so does the throughput job's
profile of each timed row (`neobert.instruments.timing.profile_step`, `profile=true`).

Categories by name only: a pointwise kernel of the eager RMSNorm (a multiply, an rsqrt) is "elementwise", not
"norm"; a fused Inductor kernel is "norm" when it computes an rsqrt, else "elementwise". Names no rule knows are
"other", and the largest of them are listed (`KernelProfile.other_names`) so that a reader can add a rule.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from neobert.config.pretrain import CUDA_GRAPH_MODES
from neobert.instruments.host_waits import HostWaitReport, host_waits, read_trace

log = logging.getLogger(__name__)

MATMUL, ATTENTION, MLM_LOSS, NORM, ELEMENTWISE, COPY, OPTIMIZER, COMMUNICATION, OTHER = (
    "matmul (GEMM)", "attention", "MLM loss", "norm", "elementwise", "copy/cast", "optimizer", "communication",
    "other")
CATEGORIES = (MATMUL, ATTENTION, MLM_LOSS, NORM, ELEMENTWISE, COPY, OPTIMIZER, COMMUNICATION, OTHER)

# (category, pattern), the first match wins; patterns are searched in the lower-cased name. The order matters: the
# loss before attention (the loss's log-softmax kernel is cunn_SoftMaxForward<..., LogSoftMaxForwardEpilogue>, an
# attention softmax has SoftMaxForwardEpilogue), attention before matmul (fmha_cutlass... is attention), copy before
# elementwise (a dtype cast is vectorized_elementwise_kernel<..., bfloat16_copy_kernel_cuda...>).
RULES: tuple[tuple[str, re.Pattern], ...] = tuple((category, re.compile(pattern)) for category, pattern in (
    # a training loop's collectives: NCCL's kernels (ncclDevKernel_AllReduce_Sum_bf16_RING_LL), the c10d and Gloo
    # operators on a CPU, the profiler's record of a collective
    (COMMUNICATION, r"nccl|gloo|^c10d::|record_param_comms"),
    # a training loop's optimizer step: fused and foreach Adam/AdamW (multi_tensor_apply_kernel<...FusedAdamMath
    # Functor...>, aten::_fused_adamw_), DeepSpeed's, the foreach ops of gradient clipping (its _foreach_norm).
    # Before the elementwise rule, which would take a kernel named ...Functor. A gradient norm computed tensor by
    # tensor (torch.linalg.vector_norm) is "norm": a name says what a kernel computes, not for whom.
    (OPTIMIZER, r"adam|foreach|multi_tensor_apply|^aten::_fused_sgd"),
    # cross-entropy = log-softmax + NLL, eager (aten::_log_softmax, aten::nll_loss_forward and their CUDA kernels),
    # Liger's (_cross_entropy_kernel, fused linear cross-entropy) and Inductor's (triton_..._log_softmax_...)
    (MLM_LOSS, r"cross_entropy|log_?softmax|nll_loss"),
    # FlashAttention (flash_fwd_kernel, pytorch_flash::...), memory-efficient (fmha_cutlassF/B), cuDNN's SDPA,
    # PyTorch's varlen and CPU SDPA (aten::_scaled_dot_product_flash_attention_for_cpu), xFormers; a plain softmax
    # is an attention's (the loss's was caught above)
    (ATTENTION, r"flash|fmha|attention|attn|sdpa|softmax"),
    # cuBLAS/cuBLASLt (sm90_xmma_gemm..., ampere_bf16_s16816gemm..., nvjet_..., splitKreduce), CUTLASS, Inductor's
    # matmul templates (triton_tem_fused_mm...), and the CPU's matmul operators
    (MATMUL, r"gemm|xmma|nvjet|cublas|cutlass|wgmma|s16816|s1688|splitkreduce|^triton_tem_\w*mm"
             r"|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$"),
    # RMSNorm / LayerNorm kernels and operators (Liger's _rms_norm_forward_kernel, aten::_fused_rms_norm, PyTorch's
    # layer-norm kernels that also serve RMSNorm, their weight-gradient GammaBeta kernels), the vector norm of
    # rms_norm_in_dtype (reduce_kernel<..., NormTwoOps...>: the CPU's bf16 path; before 139d97c, CUDA's too),
    # Inductor's fused norm (an rsqrt)
    (NORM, r"rms_?norm|layer_?norm|gammabeta|normtwoops|vector_norm|^triton_\w*rsqrt"),
    # Inductor's other fused kernels: pointwise and reductions. On a CPU its generated C++ kernels are no operators
    # of their own: their time is the self time of the compiled graph's range (its matmuls stay aten operators)
    (ELEMENTWISE, r"^triton_(poi|red|per)_|^## call compiledfxgraph"),
    # copies and casts, and the data movement that does no arithmetic: concatenation, index/gather/scatter, the
    # embedding's lookup and gradient, memcpy and memset
    (COPY, r"copy|memcpy|memset|^aten::(to|clone|contiguous|cat|index|index_select|gather|scatter)$"
           r"|index_?select|indexselect|index_?put|gather|scatter|catarray|embedding"),
    # pointwise kernels (at::native::vectorized_elementwise_kernel<...MulFunctor...>), reductions, Liger's SwiGLU
    (ELEMENTWISE, r"elementwise|reduce_kernel|functor|swiglu|geglu"
                  r"|^aten::(mul|add|sub|div|neg|pow|rsqrt|sqrt|exp|silu|sigmoid|gelu|tanh|where|fill|zero|clamp"
                  r"|mean|sum|masked_fill|square|reciprocal)(_\w*)?$"),
))


def category_of(name: str) -> str:
    """The category of a kernel or operator name (`RULES`; "other" when none matches)."""
    lowered = name.lower()
    return next((category for category, pattern in RULES if pattern.search(lowered)), OTHER)


@dataclass
class NameTime:
    """One kernel or operator name: its self time over the recording, its calls, its category."""

    name: str
    category: str
    self_us: float
    calls: int


@dataclass
class CategoryTotal:
    """One category of a recording: its self time, its share of the total, its distinct names and their calls."""

    category: str
    self_us: float
    share: float
    names: int
    calls: int


NAME_COLUMNS = ["category", "self_ms", "calls", "name"]  # the columns of `KernelProfile.name_table`


@dataclass
class KernelProfile:
    """A recording's self time by category. `self_us` holds every category of CATEGORIES (0 where none ran), in
    that order; they sum to `total_us`."""

    source: str  # what was timed: "CUDA kernels" (device time) or "CPU operators" (self CPU time)
    steps: int
    wall_us: float  # the recorded steps' wall time (the profiler's overhead included)
    total_us: float
    self_us: dict[str, float]
    names: list[NameTime] = field(default_factory=list)  # every name, the largest self time first
    # On a GPU: the time the device was running something (`device_busy_us`); the rest of wall_us it waited for
    # the host. None for a CPU recording (its operators run on the host itself).
    busy_us: float | None = None
    tokens: int | None = None  # the tokens the recorded steps trained on, where the recorder counted them
    # On a GPU, read from the recording's Chrome trace: where the device waited on the host (`read_host_waits`)
    host_waits: HostWaitReport | None = None

    def read_host_waits(self, trace_path: str | Path) -> None:
        """Sets `host_waits` from the recording's exported trace; a trace that cannot be read is logged, the rest of
        the profile kept (a help to it, whose figures stand without)."""
        try:
            self.host_waits = host_waits(read_trace(trace_path))
        except Exception as err:  # noqa: BLE001 - logged; the profile's own figures stand
            log.warning("where the device waited was not read from %s: %s: %s", trace_path, type(err).__name__, err)

    def share(self, category: str) -> float:
        return self.self_us[category] / self.total_us if self.total_us else 0.0

    def names_in(self, category: str) -> list[NameTime]:
        """The category's names, the largest self time first."""
        return [entry for entry in self.names if entry.category == category]

    def category_totals(self) -> list[CategoryTotal]:
        """Every category, in CATEGORIES' order (the report's table and its CSV)."""
        totals = []
        for category, self_us in self.self_us.items():
            names = self.names_in(category)
            totals.append(CategoryTotal(category, self_us, self.share(category), len(names),
                                        sum(entry.calls for entry in names)))
        return totals

    def name_table(self) -> list[list]:
        """Every name as a table row under NAME_COLUMNS, the largest self time first (what a new rule would be
        written from)."""
        return [[entry.category, f"{entry.self_us / 1e3:.4f}", entry.calls, entry.name] for entry in self.names]

    def other_names(self, top: int = 10) -> list[NameTime]:
        """The largest names no rule knows: where a new rule would pay off most."""
        return self.names_in(OTHER)[:top]


def summarise(times: Iterable[tuple[str, float]], source: str, steps: int, wall_us: float,
              busy_us: float | None = None, tokens: int | None = None) -> KernelProfile:
    """(name, self time in µs) of every kernel or operator call -> their totals per name and per category."""
    totals: dict[str, list[float]] = {}
    for name, self_us in times:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += self_us
        entry[1] += 1
    names = sorted((NameTime(name, category_of(name), total, int(calls)) for name, (total, calls) in totals.items()),
                   key=lambda entry: -entry.self_us)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for entry in names:
        by_category[entry.category] += entry.self_us
    return KernelProfile(source, steps, wall_us, sum(by_category.values()), by_category, names, busy_us, tokens)


def profiler_activities(device: torch.device) -> list[ProfilerActivity]:
    """What torch.profiler records here: the CPU's operators, and on a GPU its kernels and copies."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def trace_graphs_captured_from_now(device: torch.device) -> None:
    """Sets the profiler's CUDA tracer up before any CUDA graph is captured (compile modes reduce-overhead and
    max-autotune): else a later recording misses the kernels a graph replays (pytorch/pytorch#100441;
    torch.profiler._utils._init_for_cuda_graphs does the same). A replay is one launch, so the tracer's cost per
    launch hardly touches the timings. A no-op off CUDA."""
    if device.type == "cuda":
        with profile(activities=profiler_activities(device)):
            pass


def cuda_graphs_or_error(device: torch.device, compile_mode: str) -> contextlib.AbstractContextManager:
    """Where a run measures CUDA graphs (compile_mode reduce-overhead or max-autotune, on a GPU), Inductor's
    `cudagraph_or_error`: what Inductor reports as skipping its CUDA graphs with a warning (an input mutated outside
    the graph, too many re-recordings, several devices) raises with its reason instead. Not everything: with graph
    partitioning (on by default in torch 2.11) a CPU node or an op unsafe to capture is split out to run eagerly
    between graphs without a word, and a graph with non-tensor inputs runs without graphs unreported."""
    if device.type == "cuda" and compile_mode in CUDA_GRAPH_MODES:
        return torch._inductor.config.patch({"triton.cudagraph_or_error": True})
    return contextlib.nullcontext()


def summarise_events(events, on_gpu: bool, steps: int, wall_us: float, tokens: int | None = None) -> KernelProfile:
    """A finished recording's events (`prof.events()`) of `steps` steps that took `wall_us` -> their self time by
    category: a GPU's kernels (and the device's busy time), else the CPU's operators."""
    return summarise(self_times(events, on_gpu), "CUDA kernels" if on_gpu else "CPU operators", steps, wall_us,
                     device_busy_us(events) if on_gpu else None, tokens)


def self_times(events, on_gpu: bool) -> list[tuple[str, float]]:
    """(name, self time in µs) of a torch.profiler recording's events (`prof.events()`): on a GPU its CUDA kernels
    and memory copies (the device's time: the CPU's operators only launch them), on a CPU its operators' self
    time (an operator's time less its children's, so nothing is counted twice). User annotations are left out: on
    the GPU timeline a compiled graph's "## Call CompiledFxGraph ##" range spans its kernels (torch's own device
    totals leave them out, or the compiled work would count twice); on a CPU a `record_function` range
    (DistributedDataParallel.forward, Optimizer.step#AdamW.step) has as self time the Python between its operators,
    which a recording without such ranges does not count anywhere: two recordings compare operator for operator. (A
    compiled graph's range on a CPU is no user annotation: its self time is Inductor's C++ kernels, kept: RULES.)"""
    if on_gpu:
        return [(event.name, event.time_range.elapsed_us()) for event in events
                if event.device_type == DeviceType.CUDA and not event.is_user_annotation]
    events = [event for event in events if event.device_type == DeviceType.CPU and not event.is_user_annotation]
    callers = [attention_caller(event) for event in events]
    backward_callers = {(event.thread, event.sequence_nr): caller for event, caller in zip(events, callers)
                        if caller and event.sequence_nr >= 0}
    return [(attributed_name(event, caller, backward_callers), event.self_cpu_time_total)
            for event, caller in zip(events, callers)]


# A CPU operator called by attention's own (SDPA's math path: its aten::bmm, aten::mul) is attention's work, and so is
# its backward: named after the nearest such caller, so that the rules file them there, not under matmul or
# elementwise. The backward runs under autograd's nodes, which carry the forward operator's thread and sequence number
ATTENTION_CALLERS = re.compile(r"scaled_dot_product|flex_attention|_efficient_attention|_flash_attention")
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def attention_caller(event) -> str | None:
    """The name of the nearest attention operator (`ATTENTION_CALLERS`) that called this CPU event, if any."""
    caller = event.cpu_parent
    while caller is not None and not ATTENTION_CALLERS.search(caller.name.lower()):
        caller = caller.cpu_parent
    return None if caller is None else caller.name


def attributed_name(event, caller: str | None, backward_callers: dict[tuple[int, int], str]) -> str:
    """A CPU event's name, prefixed "<caller> > " where an attention operator called it (`caller`, its
    `attention_caller`), or "<caller> (backward) > " where it runs in the backward of an operator that one called
    (`backward_callers`: (thread, sequence number) of those forward operators -> their caller)."""
    if category_of(event.name) == ATTENTION:
        return event.name
    if caller:
        return f"{caller} > {event.name}"
    node = event
    while node is not None:
        if node.name.startswith(AUTOGRAD_NODE) and (node.fwd_thread, node.sequence_nr) in backward_callers:
            return f"{backward_callers[node.fwd_thread, node.sequence_nr]} (backward) > {event.name}"
        node = node.cpu_parent
    return event.name


def device_busy_us(events) -> float:
    """The time a GPU recording's device was busy: the union of its kernels' and copies' time ranges (`self_times`'
    events), so that work of two streams at once (a collective beside the backward) counts once. Beside the
    recording's wall time, the rest is the device waiting for the host: launches, Python, host reads."""
    spans = sorted((event.time_range.start, event.time_range.end) for event in events
                   if event.device_type == DeviceType.CUDA and not event.is_user_annotation)
    busy, covered_to = 0.0, float("-inf")
    for start, end in spans:
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return busy
