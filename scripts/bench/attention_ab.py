"""NeoBERT's attention alone on full rows (no padding), bf16, each way it could run (which kernel serves
compiled inference best, FlashAttention 4 or SDPA's cuDNN kernel, timed apart from the model):

* sdpa: `F.scaled_dot_product_attention` on q, k, v as the model hands them over (views of the fused projection's
  output, [batch, heads, length, head_dim] after a transpose; no mask), PyTorch's choice of kernel (cuDNN's first
  on Hopper and Blackwell with cuDNN 9.15 or later, else FlashAttention 2);
* sdpa_cudnn, sdpa_flash, sdpa_efficient: the same with one backend forced (`sdpa_kernel`), where it runs;
* sdpa_compiled: the same call under `torch.compile` (the kernel Inductor chose when tracing, called with its layout
  constraints): whether a compiled model's attention loses what the eager call has;
* compiled_cudnn: the same compiled with cuDNN first in SDPA's priority (`sdpa_kernel(..., set_priority=True)`
  inside the compiled function, which Dynamo traces in one graph under torch 2.11 and 2.13): whether a compiled
  call can have cuDNN's kernel back. Its context sets SDPA's process-wide order and restores the one it found: it
  runs after `sdpa`, whose first call on a GPU has let PyTorch set its own order;
* fa4: `neobert.model.flash_attn_4.flash_attn_4_varlen`, the model's op (the rows as documents, cu_seqlens), and
  fa4_dense, FlashAttention 4's batched `flash_attn_func`, where flash-attn-4 and a GPU are (their own alternation:
  failing costs only their rows);
* fa4_128x128, fa4_dense_128x128 (forward alone): the same through FA4's `_flash_attn_fwd` with 128 x 128 tiles. On
  Hopper its forward takes 192 query rows a tile at head size 64 (4.0.0b36's `_tile_size_fwd_sm90`, whose comment
  says 192 x 128 "is consistently best across seqlens"): a row of 512 then takes three tiles, 576 rows, and 1,024
  six, 1,152, so 11% of the rows it computes are empty; 128 divides both. The varlen one writes the logsumexp, as
  the model's op asks for it, so that only the tile differs.

Forward alone (inference, under no_grad) and forward + backward (training; q, k and v each their own leaf, so that
no split's backward is timed), each alternated, the median of `repeats`; each output's (and in training each
gradient's) largest error against attention written out in float32 (einsum, softmax), over its largest value.

    python scripts/bench/attention_ab.py [TOKENS=32768] [REPEATS=20] [LENGTH=512]     # CUDA when there is a GPU
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from neobert.instruments.ab import (CallTime, compare, device_label, optional_attribute, samples_described,
                                    seconds_per_call)
from neobert.model import NeoBERTConfig
from neobert.model.attention import cu_seqlens_of_rows
from neobert.model.flash_attn_4 import flash_attn_4_varlen

FORCED = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
          "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q, k, v):
    """The model's padded-layout call (neobert.model.attention.attend without a mask): [B, L, h, d] in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def forced(backend: SDPBackend):
    def attend(q, k, v):
        with sdpa_kernel(backend):
            return sdpa(q, k, v)
    return attend


def cudnn_first(q, k, v):
    """`sdpa` with cuDNN's kernel first in SDPA's choice, the others after it in PyTorch's order (a preference: a
    shape cuDNN cannot take falls back)."""
    with sdpa_kernel(CUDNN_FIRST, set_priority=True):
        return sdpa(q, k, v)


def on_rows_as_documents(varlen, q, k, v):
    """`varlen(q, k, v, cu_seqlens, length)` ([T, h, d] in and out) on the rows of q, k, v ([B, L, h, d]) laid end to
    end as documents of one row each, its output in q's layout."""
    batch, length = q.shape[:2]
    cu_seqlens = cu_seqlens_of_rows(batch, length, q.device)
    return varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, length).view_as(q)


def fa4_documents(q, k, v):
    """The model's FA4 op on the rows laid end to end as documents of one row each."""
    return on_rows_as_documents(lambda *args: flash_attn_4_varlen(*args)[0], q, k, v)


def fa4_variants(training: bool) -> tuple[dict, str | None]:
    """FlashAttention 4's candidates beside `sdpa`, or ({}, why) where flash-attn-4 does not import. The 128 x 128
    tiles in the forward alone: `_flash_attn_fwd` (what FA4's autograd functions call) takes a tile, its public
    functions do not."""
    dense, why = optional_attribute("flash_attn.cute", "flash_attn_func")
    if dense is None:
        return {}, why
    variants = {"sdpa": sdpa, "fa4": fa4_documents, "fa4_dense": lambda q, k, v: dense(q, k, v)[0]}
    if training:
        return variants, None
    forward, why = optional_attribute("flash_attn.cute.interface", "_flash_attn_fwd")
    if forward is None:
        print(f"  {'fa4_128x128':17s} not measured: {why}")
        return variants, None

    def tiled(q, k, v, cu_seqlens, length):
        return forward(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=length,
                       max_seqlen_k=length, tile_mn=(128, 128),
                       return_lse=True)[0]  # as the model's op (`fa4`): only the tile differs

    variants["fa4_128x128"] = lambda q, k, v: on_rows_as_documents(tiled, q, k, v)
    variants["fa4_dense_128x128"] = lambda q, k, v: forward(q, k, v, tile_mn=(128, 128))[0]
    return variants, None


def reference_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v in float32 with einsum: none of SDPA's code, on [B, L, h, d]."""
    scores = torch.einsum("blhd,bmhd->bhlm", q.float(), k.float()) / q.shape[-1] ** 0.5
    return torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v.float())


def main(tokens: int = 32768, repeats: int = 20, length: int = 512) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if tokens % length:
        raise ValueError(f"TOKENS must be a multiple of LENGTH={length} (full rows), got {tokens}")
    batch = tokens // length
    config = NeoBERTConfig.from_preset("neobert")
    heads, head_dim = config.num_attention_heads, config.head_dim
    torch.manual_seed(0)
    qkv = torch.randn(batch, length, heads, 3 * head_dim, device=device).to(torch.bfloat16)  # the fused projection
    grad = torch.randn(batch, length, heads, head_dim, device=device).to(torch.bfloat16)

    def views(requires_grad: bool):
        """q, k, v: strided views of the fused projection, as the model's split leaves them, each its own leaf."""
        return [view.detach().requires_grad_(requires_grad) for view in qkv.split(head_dim, dim=-1)]

    leaves = views(True)
    reference = reference_attention(*leaves)
    reference.backward(grad.float())
    reference_grads = [leaf.grad for leaf in leaves]

    def timed(attend, training: bool) -> CallTime:
        def step():
            if training:
                attend(*views(True)).backward(grad)
            else:
                with torch.no_grad():
                    attend(*views(False))
        return seconds_per_call(step, device)

    def relative(got, expected) -> float:
        return ((got.float() - expected).abs().max() / expected.abs().max()).item()

    def errors(attend, training: bool) -> str:
        if not training:
            with torch.no_grad():
                return f"output {relative(attend(*views(False)), reference):.2e}"
        leaves = views(True)
        out = attend(*leaves)
        out.backward(grad)
        worst = max(relative(leaf.grad, expected) for leaf, expected in zip(leaves, reference_grads))
        return f"output {relative(out, reference):.2e}, gradients {worst:.2e}"

    flops = 4 * batch * length * length * heads * head_dim  # QK^T and PV, 2 FLOPs per multiply-add
    print(f"Attention, {batch} x {length} tokens x {heads} heads x {head_dim}, no mask, bf16, {device_label(device)}, "
          f"torch {torch.__version__}, {samples_described(repeats)}")
    for training in (False, True):
        work = flops * (3 if training else 1)  # the backward counted twice the forward, as the model's MFU counts it
        print(f"{'Forward + backward (training)' if training else 'Forward alone (inference)'}, median of {repeats}")

        def describe(attend, median: float, first: float) -> str:
            return (f"{median * 1e3:8.3f} ms  {work / median / 1e12:6.1f} TFLOP/s  {first / median:5.2f}x sdpa  "
                    f"max error vs float32: {errors(attend, training)}")

        variants = {"sdpa": sdpa, **{name: forced(backend) for name, backend in FORCED.items()},
                    "sdpa_compiled": torch.compile(sdpa, dynamic=False),
                    # fullgraph: a graph break would run SDPA eagerly, cuDNN's kernel included, under this row's name
                    "compiled_cudnn": torch.compile(cudnn_first, dynamic=False, fullgraph=True)}
        print("\n".join(compare(variants, lambda attend: timed(attend, training), describe, repeats, width=14)))
        if device.type == "cuda":  # FlashAttention 4, candidates in an alternation of their own
            candidates, why = fa4_variants(training)
            if why:
                print(f"  {'fa4':17s} not measured: {why}")
                continue
            print("\n".join(compare(candidates, lambda attend: timed(attend, training), describe, repeats,
                                    width=17)))


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
