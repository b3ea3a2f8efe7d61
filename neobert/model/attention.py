"""Attention backends behind one interface (the rotary position tables: `neobert.model.rope`).

A forward pass describes its batch once in an :class:`AttentionLayout` (built before the first layer, so no
layer rebuilds a mask), and every layer calls :func:`attend` with it.

* padded (``sdpa`` backend): q/k/v are ``[B, L, heads, head_dim]``; padded keys are hidden by a boolean
  key-padding mask, or no mask at all when the batch has no padding (which lets PyTorch pick flash kernels).
* packed (``varlen`` backend): q/k/v are ``[T, heads, head_dim]``, the documents of the batch laid end to end
  and described by ``cu_seqlens``; no document attends to another. Zero-length documents (the repeated last offset
  that keeps a static packed batch's cu_seqlens one length) are allowed: varlen kernels take them as empty
  sequences; in the fallback their grid rows are wholly masked (SDPA gives 0 there, not NaN), never gathered.

The packed kernel is `NeoBERTConfig.attention_kernel` (a choice of the machine, never written to config.json):

* ``auto``, fastest first: FlashAttention 3 (``flash_attn_3`` installed, a Hopper GPU, sm90; no dropout),
  FlashAttention 4 (``flash-attn-4`` installed and importable, a Hopper or Blackwell GPU, sm90/sm100, a head size
  it takes; in training, no dropout, where it is faster than ``varlen_attn``, docs/benchmarks.md; evaluation and
  inference keep the next kernel, as its forward alone has no such figure), flash-attn's varlen kernel
  (``flash_attn`` installed), PyTorch's ``varlen_attn`` (FlashAttention 2 inside PyTorch; no dropout), xFormers'
  block-diagonal attention (installed, for dropout), else ``padded_sdpa``: all but the last on CUDA tensors in
  bf16/fp16 only;
* an explicit kernel (``flash_attn_4``, ``flash_attn_3``, ``flash_attn``, ``varlen_attn``, ``xformers``,
  ``padded_sdpa``) runs as asked on CUDA tensors, or raises naming the field where it cannot (a dtype or a dropout it
  does not take; a missing package is refused when the config is built). On other devices every choice runs
  ``padded_sdpa``, as Liger's kernels fall back to eager on CPU: tests and CPU runs of a GPU recipe work unchanged;
* ``flash_attn_4`` is the flash-attn-4 package: pure Python on NVIDIA's CuTe DSL, so installable from PyPI where
  FlashAttention 3 must be built. It runs as two custom ops (forward, backward) so that a compiled model keeps one
  graph around it;
* ``padded_sdpa``: the documents scattered into a padded batch, SDPA with a key-padding mask, gathered back.

Padded batches run SDPA under every choice: with padding it needs a mask, which FlashAttention takes none of (the
``varlen`` backend unpads them instead, outside training); without padding PyTorch picks its own flash kernel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

from neobert.model.flash_attn_4 import flash_attn_4_varlen


def flash_attn_packages() -> tuple[bool, bool]:
    """(flash-attn 2 importable, flash-attn-4 importable), read without importing either. Both install the package
    `flash_attn`, so finding that name says neither: flash-attn-4 installs only its `cute` folder (alone, `flash_attn`
    is a namespace package, with no __init__.py and no `flash_attn_varlen_func`), and flash-attn 2 (2.8.3) ships an
    early `flash_attn/cute/` of its own, without the CuTe DSL it imports. So flash-attn 2 is a regular package
    `flash_attn`, and flash-attn-4 is its distribution's `flash_attn` folder, where Python looks for the package's
    modules (a regular flash-attn 2 found first elsewhere on sys.path hides it)."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return False, False
    try:
        flash_attn_4 = importlib.metadata.distribution("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return spec.origin is not None, False
    searched = {Path(folder).resolve() for folder in spec.submodule_search_locations or ()}
    return spec.origin is not None, Path(flash_attn_4.locate_file("flash_attn")).resolve() in searched


_HAS_FLASH_ATTN_3 = importlib.util.find_spec("flash_attn_interface") is not None  # the flash_attn_3 package
_HAS_FLASH_ATTN, _HAS_FLASH_ATTN_4 = flash_attn_packages()
_HAS_XFORMERS = importlib.util.find_spec("xformers") is not None
_HALF = (torch.float16, torch.bfloat16)

ATTENTION_KERNELS = ("auto", "flash_attn_4", "flash_attn_3", "flash_attn", "varlen_attn", "xformers", "padded_sdpa")
_HALF_ONLY = ("flash_attn_4", "flash_attn_3", "flash_attn", "varlen_attn")  # FlashAttention kernels: bf16/fp16 only
_NO_DROPOUT = ("flash_attn_4", "flash_attn_3", "varlen_attn")  # none of them takes a dropout probability


@dataclass
class AttentionLayout:
    """How the tokens of one forward pass are laid out; built once per forward pass."""

    # padded layout
    key_padding_mask: Tensor | None = None  # bool [B, 1, 1, L], True = attend; None = no padding
    # packed layout
    cu_seqlens: Tensor | None = None  # int32 [n_docs + 1]
    max_seqlen: int = 0
    pad_index: Tensor | None = None  # long [T]: where each packed token sits in a [n_docs * max_seqlen] grid
    pad_mask: Tensor | None = None  # bool [n_docs, 1, 1, max_seqlen]
    # xFormers' block-diagonal mask, built by the first layer that needs it and reused by the others
    _xformers_bias: Any = field(default=None, repr=False, compare=False)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def xformers_bias(self, fmha) -> Any:
        """xFormers' `BlockDiagonalMask` of the documents. It takes the lengths as Python ints: they are read from
        the device once per forward (here, by the first layer), not once per layer."""
        if self._xformers_bias is None:
            lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
            self._xformers_bias = fmha.BlockDiagonalMask.from_seqlens(lengths)
        return self._xformers_bias

    @classmethod
    def padded(cls, attention_mask: Tensor | None, skip_if_full: bool = True) -> "AttentionLayout":
        """`skip_if_full`: no mask when the batch has no padding (flash kernels), which reads the mask on the host."""
        if attention_mask is None or (skip_if_full and bool(attention_mask.all())):
            return cls()
        return cls(key_padding_mask=attention_mask.bool()[:, None, None, :])

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, max_seqlen: int | None = None,
                        total: int | None = None) -> "AttentionLayout":
        """`max_seqlen` and `total` (the number of tokens), when the caller knows them, spare reading the device
        on the host (and keep a compiled graph whole)."""
        cu_seqlens = cu_seqlens.to(torch.int32)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if max_seqlen is None:
            max_seqlen = int(lengths.max())
        n_docs = lengths.numel()
        positions = position_ids_from_cu_seqlens(cu_seqlens, total)
        doc_index = torch.repeat_interleave(torch.arange(n_docs, device=cu_seqlens.device), lengths.long(),
                                            output_size=positions.numel())
        pad_index = doc_index * max_seqlen + positions
        grid = torch.arange(max_seqlen, device=cu_seqlens.device)
        pad_mask = (grid[None, :] < lengths[:, None])[:, None, None, :]
        return cls(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pad_index=pad_index, pad_mask=pad_mask)


def cu_seqlens_of_rows(rows: int, length: int, device: torch.device | str | None = None) -> Tensor:
    """cu_seqlens (int32) of `rows` documents of `length` tokens laid end to end: full rows taken as documents."""
    return torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)


def position_ids_from_cu_seqlens(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """Positions that restart at 0 at the start of every packed document (`total`: the number of tokens)."""
    cu_seqlens = cu_seqlens.long()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    total = int(cu_seqlens[-1]) if total is None else total
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def attend(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout, dropout_p: float = 0.0,
           kernel: str = "auto") -> Tensor:
    """softmax(q k^T / sqrt(d)) v. Returns the same layout as q: [B, L, h, d] padded or [T, h, d] packed.
    `kernel`: NeoBERTConfig.attention_kernel, the packed layout's kernel (padded batches run SDPA)."""
    if layout.packed:
        return _attend_packed(q, k, v, layout, dropout_p, kernel)
    out = masked_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout.key_padding_mask, dropout_p)
    return out.transpose(1, 2)


# pytorch/pytorch#196678: since torch 2.11, on Hopper (H100/H200), cuDNN's SDPA backward returns NaN in q's gradient
# when a mask is given, the keys' length is 64 more than a multiple of 128 and a query row's logsumexp is below
# ln(FLT_MAX) = -88.7 (the padded half of its last 128-key tile is scored 0, not -inf; huggingface/trl#7181 met it in
# training). PyTorch picks cuDNN for masked SDPA on Hopper, and the fine-tuning collators pad to a multiple of 8: one
# batch length in 16. The issue is closed upstream without a release named here, so every torch from 2.11 is guarded.
_CUDNN_MASKED_BACKWARD_NAN_SINCE = (2, 11)


def cudnn_masked_backward_exposed(device_type: str, length: int, masked: bool, needs_grad: bool,
                                  capability: Callable[[], tuple[int, int]], torch_version: str = torch.__version__
                                  ) -> bool:
    """Whether a masked SDPA call meets pytorch#196678's conditions but the logits' (which only the data decides):
    on a Hopper GPU (`capability()`, read last), under torch 2.11 or later (its pre-releases and NVIDIA's builds,
    2.11.0a0+..., included), with a mask, keys 64 more than a multiple of 128, and a backward."""
    return (device_type == "cuda" and masked and needs_grad and length % 128 == 64
            and tuple(map(int, re.match(r"(\d+)\.(\d+)", torch_version).groups())) >= _CUDNN_MASKED_BACKWARD_NAN_SINCE
            and capability()[0] == 9)


def sdpa_backends_without_cudnn() -> list[SDPBackend]:
    """The SDPA backends enabled now (globally, or by an enclosing `sdpa_kernel`), cuDNN's left out."""
    enabled = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
               (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
               (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()))
    return [backend for backend, on in enabled if on]


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """SDPA over [B, heads, L, d] with a boolean mask (None: none), cuDNN's kernel left out of the calls that meet
    pytorch#196678 (`cudnn_masked_backward_exposed`): PyTorch then takes the memory-efficient kernel, which is correct
    there. Eager calls only: compiled, SDPA's choice is made at tracing, where this reading of the global flags is not
    (a compiled padded training step, `data.unpad=false` under `model.compile`, stays as PyTorch chooses)."""
    guard = contextlib.nullcontext()
    if not torch.compiler.is_compiling() and cudnn_masked_backward_exposed(
            q.device.type, k.shape[-2], mask is not None, torch.is_grad_enabled() and q.requires_grad,
            lambda: torch.cuda.get_device_capability(q.device)):  # q's GPU, not the current one
        backends = sdpa_backends_without_cudnn()
        guard = sdpa_kernel(backends) if backends else guard  # only cuDNN enabled: the caller's own choice
    with guard:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def attention_kernel_missing_reason(kernel: str) -> str | None:
    """Why an explicit `NeoBERTConfig.attention_kernel` cannot be used on this machine: its package is not installed
    (None when it is, or when the kernel is PyTorch's own)."""
    if kernel == "flash_attn_3" and not _HAS_FLASH_ATTN_3:
        return ("needs FlashAttention 3 (the flash_attn_3 package, module flash_attn_interface; not on PyPI: built "
                "from the hopper/ folder of github.com/Dao-AILab/flash-attention, `cd hopper && python setup.py "
                "install`)")
    if kernel == "flash_attn_4" and not _HAS_FLASH_ATTN_4:
        return ("needs FlashAttention 4 (pip install flash-attn-4: pure Python on NVIDIA's CuTe DSL, for Hopper sm90 "
                "and Blackwell sm100 GPUs)")
    if kernel == "flash_attn" and not _HAS_FLASH_ATTN:
        return "needs the flash-attn package (pip install flash-attn --no-build-isolation)"
    if kernel == "xformers" and not _HAS_XFORMERS:
        return "needs the xformers package (pip install xformers)"
    return None


@torch.compiler.assume_constant_result  # read once when compiled, not a graph break in every layer
def cuda_capability() -> tuple[int, int]:
    """The current CUDA device's compute capability ((9, 0): Hopper; (10, 0): Blackwell), (0, 0) without one. `auto`
    takes FlashAttention 3 on sm90 only and FlashAttention 4 on sm90/sm100, the GPUs they were built for (each rank
    sets its own device before the first forward)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


# FlashAttention 4's head sizes by GPU generation (4.0.0b36's _validate_head_dims, q's and v's alike): multiples of 8,
# 8-256 on Hopper; 8-128 or 256 on Blackwell
_FLASH_ATTN_4_HEAD_DIMS = {9: lambda d: d % 8 == 0 and 8 <= d <= 256,
                           10: lambda d: d % 8 == 0 and (8 <= d <= 128 or d == 256)}
# The keywords our two ops pass FA4's functions (its backward `_flash_attn_bwd` is not public API)
_FLASH_ATTN_4_KEYWORDS = {"flash_attn_varlen_func": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                                     "return_lse"),
                          "_flash_attn_bwd": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
# Its answer, once per process (one warning). Not functools.cache: Dynamo traces through a cache wrapper, past
# assume_constant_result, into the import (a UserWarning at every compile, tried)
_flash_attn_4_usable_cache: list[bool] = []


@torch.compiler.assume_constant_result  # once per process, outside any graph (an import is no op of one)
def _flash_attn_4_usable() -> bool:
    """Whether FlashAttention 4 imports and its two functions take the keywords our ops pass: a package found is not
    enough for `auto` (CuTe DSL's compiler loads at import; another flash-attn-4 version may rename its private
    backward). Where not, `auto` takes the next kernel, with one warning that says why."""
    if not _flash_attn_4_usable_cache:
        try:
            from flash_attn.cute import flash_attn_varlen_func  # optional GPU kernel package (FlashAttention 4)
            from flash_attn.cute.interface import _flash_attn_bwd  # optional GPU kernel package (FlashAttention 4)

            functions = {"flash_attn_varlen_func": flash_attn_varlen_func, "_flash_attn_bwd": _flash_attn_bwd}
            missing = [f"{name}({keyword}=)" for name, keywords in _FLASH_ATTN_4_KEYWORDS.items()
                       for keyword in keywords if keyword not in inspect.signature(functions[name]).parameters]
            problem = f"its functions lack {missing} (written against 4.0.0b36)" if missing else None
        except Exception as err:  # any failure to load it (a partial install, CuTe DSL's libraries) leaves it out
            problem = f"it does not import ({type(err).__name__}: {err})"
        if problem:
            warnings.warn(f"attention_kernel=auto: FlashAttention 4 (flash-attn-4) is installed but {problem}; "
                          f"running the next kernel", stacklevel=2)
        _flash_attn_4_usable_cache.append(problem is None)
    return _flash_attn_4_usable_cache[0]


def flash_attn_4_takes(generation: int, head_dim: int | None) -> bool:
    """Whether FlashAttention 4 runs on a GPU of this compute capability's major version (9: Hopper; 10: Blackwell) at
    this head size (None: not known)."""
    takes_head_dim = _FLASH_ATTN_4_HEAD_DIMS.get(generation)
    return takes_head_dim is not None and (head_dim is None or takes_head_dim(head_dim))


def _flash_attn_4_runs(generation: int, head_dim: int | None) -> bool:
    """Whether `auto` takes FlashAttention 4 on a GPU of this compute capability's major version: installed and
    usable, on Hopper or Blackwell, at this head size (None: not known)."""
    return _HAS_FLASH_ATTN_4 and flash_attn_4_takes(generation, head_dim) and _flash_attn_4_usable()


def before_ampere(capability: tuple[int, int]) -> bool:
    """A GPU older than Ampere (compute capability below 8.0): no bf16, and no FlashAttention kernel (each needs
    sm80 or later). (0, 0), no GPU to read, is not known to be one."""
    return 0 < capability[0] < 8


def packed_kernel(device_type: str, dtype: torch.dtype, dropout_p: float, head_dim: int | None = None,
                  training: bool = True, capability: tuple[int, int] | None = None) -> str:
    """The kernel `attention_kernel="auto"` runs a packed (cu_seqlens) batch on: "flash_attn_3", "flash_attn_4",
    "flash_attn", "varlen_attn", "xformers" or "padded_sdpa" (the fallback, `_attend_packed_by_padding`), on a GPU of
    this compute `capability` (None: the current device's). FlashAttention 4 in training only (gradients on), where it
    measured faster than varlen_attn; its forward alone against varlen_attn is not measured yet."""
    capability = cuda_capability() if capability is None else capability
    if device_type != "cuda" or dtype not in _HALF:
        return "padded_sdpa"
    if not before_ampere(capability):
        if _HAS_FLASH_ATTN_3 and dropout_p == 0.0 and capability == (9, 0):
            return "flash_attn_3"
        if dropout_p == 0.0 and training and _flash_attn_4_runs(capability[0], head_dim):
            return "flash_attn_4"
        if _HAS_FLASH_ATTN:
            return "flash_attn"
        if dropout_p == 0.0:
            return "varlen_attn"
    return "xformers" if _HAS_XFORMERS else "padded_sdpa"


def chosen_packed_kernel(choice: str, device_type: str, dtype: torch.dtype, dropout_p: float,
                         head_dim: int | None = None, training: bool = True,
                         capability: tuple[int, int] | None = None) -> str:
    """The kernel a packed batch runs on under `NeoBERTConfig.attention_kernel=choice`: `packed_kernel`'s for
    "auto"; an explicit kernel on CUDA tensors, or a ValueError naming the field where it cannot take the dtype or
    the dropout; "padded_sdpa" on any other device, whatever the choice (as Liger's kernels fall back on CPU)."""
    if choice == "auto":
        return packed_kernel(device_type, dtype, dropout_p, head_dim, training, capability)
    if device_type != "cuda":
        return "padded_sdpa"
    if choice in _HALF_ONLY and dtype not in _HALF:
        raise ValueError(f"NeoBERTConfig.attention_kernel={choice!r} takes bfloat16 or float16 tensors, got {dtype} "
                         f"(run under bf16-mixed autocast or cast the model; 'xformers' and 'padded_sdpa' take "
                         f"float32)")
    if choice in _NO_DROPOUT and dropout_p > 0.0:
        raise ValueError(f"NeoBERTConfig.attention_kernel={choice!r} has no attention dropout, and this training step "
                         f"asks for {dropout_p} (NeoBERTConfig.dropout); 'flash_attn', 'xformers' and 'padded_sdpa' "
                         f"take it")
    return choice


def _attend_packed(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout, dropout_p: float,
                   choice: str) -> Tensor:
    cu, max_len = layout.cu_seqlens, layout.max_seqlen
    kernel = chosen_packed_kernel(choice, q.device.type, q.dtype, dropout_p, q.shape[-1], torch.is_grad_enabled())
    if kernel == "flash_attn_4":
        return flash_attn_4_varlen(q, k, v, cu, max_len)[0]
    if kernel == "flash_attn_3":
        from flash_attn_interface import flash_attn_varlen_func  # optional GPU kernel package (FlashAttention 3)

        out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len)
        # FlashAttention 3's early releases return (out, softmax_lse); later ones return out alone unless asked for the
        # lse (return_attn_probs=True, an argument the early ones lack): called without it, either return is taken.
        return out[0] if isinstance(out, tuple) else out
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func  # optional GPU kernel package

        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout_p)
    if kernel == "varlen_attn":
        return varlen_attn(q, k, v, cu, cu, max_len, max_len)
    if kernel == "xformers":
        from xformers.ops import fmha  # optional GPU kernel package

        out = fmha.memory_efficient_attention(q[None], k[None], v[None], attn_bias=layout.xformers_bias(fmha),
                                              p=dropout_p)
        return out[0]
    return _attend_packed_by_padding(q, k, v, layout, dropout_p)


def _attend_packed_by_padding(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout, dropout_p: float) -> Tensor:
    n_docs = layout.cu_seqlens.numel() - 1
    heads, dim = q.shape[1], q.shape[2]

    def to_grid(x: Tensor) -> Tensor:
        grid = x.new_zeros(n_docs * layout.max_seqlen, heads, dim)
        grid[layout.pad_index] = x
        return grid.view(n_docs, layout.max_seqlen, heads, dim).transpose(1, 2)

    out = masked_sdpa(to_grid(q), to_grid(k), to_grid(v), layout.pad_mask, dropout_p)
    return out.transpose(1, 2).reshape(n_docs * layout.max_seqlen, heads, dim)[layout.pad_index]
