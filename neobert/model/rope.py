"""Rotary position embeddings (RoPE): the rotation tables of a forward pass and the rotation of q and k, in float32
arithmetic (a complex multiply, the official code's) or, eager in 16 bits off a GPU, in the tensors' own dtype."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

_HALF = (torch.float16, torch.bfloat16)


def rope_tables(head_dim: int, positions: Tensor, theta: float) -> Tensor:
    """Unit rotations as (cos, sin) pairs, float32, shape [*positions.shape, head_dim // 2, 2]: the LLaMA
    `freqs_cis` stored as real pairs (a complex view in eager, plain reals for Inductor, which has no complex
    code generation)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


@dataclass
class RotaryTables:
    """The rotations of one forward pass, laid out for q and k side by side (`vectors_per_head` head vectors per
    head), built once before the first layer; the tables a bf16/fp16 eager rotation off a GPU needs are made on first
    use, once per dtype, not once per layer."""

    rotations: Tensor  # float32 [..., 1, vectors_per_head * head_dim // 2, 2] (rope_tables', broadcast over heads)
    _interleaved: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def side_by_side(cls, rotations: Tensor, vectors_per_head: int) -> "RotaryTables":
        """`rotations` from `rope_tables`, repeated for `vectors_per_head` vectors and given a heads axis."""
        if vectors_per_head > 1:
            rotations = torch.cat([rotations] * vectors_per_head, dim=-2)
        return cls(rotations.unsqueeze(-3))

    def interleaved(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, signed sin) per element in `dtype`: c0 c0 c1 c1 ... and -s0 s0 -s1 s1 ..., so that the rotation
        of the pairs of x is x * cos + swap_pairs(x) * sin."""
        if dtype not in self._interleaved:
            cos, sin = self.rotations.unbind(-1)
            self._interleaved[dtype] = (cos.repeat_interleave(2, dim=-1).to(dtype),
                                        torch.stack((-sin, sin), dim=-1).flatten(-2).to(dtype))
        return self._interleaved[dtype]


def swap_pairs(x: Tensor) -> Tensor:
    """(x1, x0) for every adjacent pair (x0, x1) of the last axis."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def rotate_in_dtype(x: Tensor, rotations: RotaryTables) -> Tensor:
    """`apply_rope`'s eager 16-bit rotation off a GPU: x * cos + swap_pairs(x) * signed sin in x's dtype, three
    elementwise passes and no float32 copy of x and back (addcmul adds in float32 before its one rounding): faster than
    the complex multiply on a CPU, slower on a GPU (scripts/bench/rope_ab.py)."""
    cos, signed_sin = rotations.interleaved(x.dtype)
    return torch.mul(x, cos).addcmul_(swap_pairs(x), signed_sin)


def apply_rope(x: Tensor, rotations: Tensor | RotaryTables) -> Tensor:
    """Rotates adjacent pairs (dims 0-1, 2-3, ...) of every head vector of x, and returns x's dtype.

    x is [..., heads, n * head_dim]: n head vectors side by side (q and k of the fused qkv projection, n = 2, are
    rotated in one pass). `rotations`: a `RotaryTables` for that layout (what the model builds once per forward), or
    the tables of `rope_tables` (x's leading shape without heads, then head_dim // 2 and 2; broadcast over heads).
    """
    if not isinstance(rotations, RotaryTables):
        rotations = RotaryTables.side_by_side(rotations, x.shape[-1] // (2 * rotations.shape[-2]))
    if torch.compiler.is_compiling():
        # One fused kernel computing in float32 (Inductor has no complex code generation; the real-pair `stack` form
        # wrote a float32 copy of q and k per layer, which this form does not).
        cos, signed_sin = rotations.interleaved(torch.float32)
        return (x.float() * cos + swap_pairs(x).float() * signed_sin).type_as(x)
    if x.dtype in _HALF and x.device.type != "cuda":
        return rotate_in_dtype(x, rotations)
    # float32: one complex multiply, faster than the real-pair form on CPU, and the official code's arithmetic bit for
    # bit. Eager bf16/fp16 on a GPU too, cast back once: faster there than `rotate_in_dtype`, whose multiply-adds run
    # PyTorch's non-vectorized kernels over the strided view of q and k (scripts/bench/rope_ab.py, docs/benchmarks.md).
    pairs = x.float().unflatten(-1, (-1, 2))
    rotated = torch.view_as_complex(pairs) * torch.view_as_complex(rotations.rotations)
    return torch.view_as_real(rotated).flatten(-2).type_as(x)
