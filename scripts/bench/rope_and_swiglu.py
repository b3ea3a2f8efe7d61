"""Micro-benchmarks behind two eager-mode choices of neobert/model (docs/benchmarks.md):

* RoPE: q and k rotated in one complex multiply (the model's way) against one call each (the earlier code), and
  against rotating in bf16 with real (cos, sin) pairs and no float32 round trip;
* SwiGLU: silu(gate) * up out of place against in place in the w12 output (the model's way without autograd), each
  after a clone of the w12 output (a fresh one, as in the model), whose own time is the first row and is
  subtracted.

Each table's variants alternated (neobert/instruments/ab.py), the median of `repeats`, in float32 and bf16.

    python scripts/bench/rope_and_swiglu.py [REPEATS=7] [LENGTH=512]   # batch 8 x LENGTH, 12 heads of 64, 2 threads
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from neobert.instruments.ab import compare, device_label, samples_described, seconds_per_call
from neobert.model.rope import apply_rope, rope_tables

BATCH, HEADS, HEAD_DIM, FFN = 8, 12, 64, 2048
CPU = torch.device("cpu")


def rope_in_low_precision(x, cos, sin):
    """The rotation on real pairs in x's dtype: cos/sin interleaved to head width, pairs swapped (-odd, even)."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack((pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x * cos).addcmul_(swapped, sin)


def time_one(run):
    return seconds_per_call(run, CPU)


def rope_table(dtype: torch.dtype, rotations: torch.Tensor, length: int, repeats: int) -> list[str]:
    qkv = torch.randn(BATCH, length, HEADS, 3 * HEAD_DIM).to(dtype)
    qk = qkv[..., :2 * HEAD_DIM]
    q, k = qk.chunk(2, dim=-1)
    # cos and sin for the real-pair form: each angle twice (both members of a pair), q's and k's halves, and
    # the sign of the swapped (-odd, even) pairs folded into sin.
    cos = torch.cat([rotations[..., 0].repeat_interleave(2, -1)] * 2, -1)[:, :, None, :].to(dtype)
    sin = torch.stack((-rotations[..., 1], rotations[..., 1]), -1).flatten(-2)
    sin = torch.cat([sin] * 2, -1)[:, :, None, :].to(dtype)
    expected = apply_rope(qk.float(), rotations)
    variants = {"one call": lambda: apply_rope(qk, rotations),
                "two calls": lambda: (apply_rope(q, rotations), apply_rope(k, rotations)),
                "real pairs": lambda: rope_in_low_precision(qk, cos, sin)}

    def describe(run, median: float, one_call: float) -> str:
        rotated = run()
        rotated = torch.cat(rotated, dim=-1) if isinstance(rotated, tuple) else rotated  # two calls: q's, k's
        return (f"{median * 1e3:7.2f} ms  {one_call / median:5.2f}x one call  max error vs float32: "
                f"{(rotated.float() - expected).abs().max():.2e}")

    return compare(variants, time_one, describe, repeats, width=12)


def swiglu_table(dtype: torch.dtype, length: int, repeats: int) -> list[str]:
    w12_output = torch.randn(BATCH, length, 2 * FFN).to(dtype)

    def out_of_place():
        gate, up = w12_output.clone().chunk(2, dim=-1)  # clone: a fresh w12 output, as in the model
        return F.silu(gate) * up

    def in_place():
        gate, up = w12_output.clone().chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    clone = w12_output.clone

    def describe(run, median: float, clone_median: float) -> str:
        without = "" if run is clone else f"  {(median - clone_median) * 1e3:7.2f} ms without the clone"
        return f"{median * 1e3:7.2f} ms{without}"

    return compare({"clone": clone, "out of place": out_of_place, "in place": in_place}, time_one, describe,
                   repeats, width=12)


def main(repeats: int = 7, length: int = 512) -> None:
    torch.set_num_threads(2)
    rotations = rope_tables(HEAD_DIM, torch.arange(length).expand(BATCH, length), 10000.0)
    print(f"RoPE of q and k and SwiGLU's elementwise work, batch {BATCH} x {length}, {HEADS} heads of {HEAD_DIM}, "
          f"ffn {FFN}, {device_label(CPU)}, torch {torch.__version__}, {samples_described(repeats)}")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"{dtype}: RoPE of q and k (real pairs: in {dtype})")
        print("\n".join(rope_table(dtype, rotations, length, repeats)))
        print(f"{dtype}: SwiGLU's silu(gate) * up, after a clone of the w12 output")
        print("\n".join(swiglu_table(dtype, length, repeats)))


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
