"""FlashAttention 4 over packed documents as two custom ops (forward, backward), so that a compiled model keeps one
graph around it (`neobert.model.attention` chooses when it runs)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


# FlashAttention 4 as two custom ops. Its own autograd.Function calls CuTe DSL kernels that Dynamo cannot trace (a graph
# break in every layer of a compiled model); an op is opaque to the compiler, described by its fake (output shapes)
# and its backward. The forward is FA4's public varlen function; the backward is `_flash_attn_bwd`, the function FA4's
# own backward calls, with the arguments it passes (PyTorch's own FA4 integration calls it by that name too).
def _on_device_of(tensor: Tensor) -> contextlib.AbstractContextManager:
    """The tensor's GPU as the current one while FA4 runs: it reads the current device's architecture, and launches
    there (a model on cuda:1 of a process whose current device is cuda:0)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("neobert::flash_attn_4_varlen", mutates_args=())
def flash_attn_4_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor]:
    """FlashAttention 4 over packed documents: (out [T, heads, head_dim], logsumexp float32 [heads, T])."""
    from flash_attn.cute import flash_attn_varlen_func  # optional GPU kernel package (FlashAttention 4)

    # An op's body runs below autograd: FA4's autograd.Function records nothing here; the backward is registered below
    with _on_device_of(q):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                      max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, return_lse=True)


@flash_attn_4_varlen.register_fake
def _flash_attn_4_varlen_fake(q, k, v, cu_seqlens, max_seqlen):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("neobert::flash_attn_4_varlen_backward", mutates_args=())
def flash_attn_4_varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 cu_seqlens: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `flash_attn_4_varlen`."""
    from flash_attn.cute.interface import _flash_attn_bwd  # optional GPU kernel package (FlashAttention 4)

    with _on_device_of(q):
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, grad_out, lse, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                     max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    return dq, dk, dv


@flash_attn_4_varlen_backward.register_fake
def _flash_attn_4_varlen_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_attn_4_save(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.max_seqlen = max_seqlen


def _flash_attn_4_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = flash_attn_4_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen)
    return dq, dk, dv, None, None  # the logsumexp is never used downstream: its gradient is not propagated


flash_attn_4_varlen.register_autograd(_flash_attn_4_backward, setup_context=_flash_attn_4_save)
