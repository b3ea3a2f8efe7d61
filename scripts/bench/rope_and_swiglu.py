"""Micro-benchmarks behind two eager-mode choices of neobert/model (docs/benchmarks.md, issue 15):

* RoPE: q and k rotated in one complex multiply (the model's way) against one call each (the earlier code), and
  against rotating in bf16 with real (cos, sin) pairs and no float32 round trip;
* SwiGLU: silu(gate) * up out of place against in place in the w12 output (the model's way without autograd).

    python scripts/bench/rope_and_swiglu.py            # batch 8 x 512, 12 heads of 64, 2 threads
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from neobert.model.rope import apply_rope, rope_tables

BATCH, LENGTH, HEADS, HEAD_DIM, FFN = 8, 512, 12, 64, 2048


def median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def rope_in_low_precision(x, cos, sin):
    """The rotation on real pairs in x's dtype: cos/sin interleaved to head width, pairs swapped (-odd, even)."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack((pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x * cos).addcmul_(swapped, sin)


def main() -> None:
    torch.set_num_threads(2)
    rotations = rope_tables(HEAD_DIM, torch.arange(LENGTH).expand(BATCH, LENGTH), 10000.0)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(BATCH, LENGTH, HEADS, 3 * HEAD_DIM).to(dtype)
        qk = qkv[..., :2 * HEAD_DIM]
        q, k = qk.chunk(2, dim=-1)
        # cos and sin for the real-pair form: each angle twice (both members of a pair), q's and k's halves, and
        # the sign of the swapped (-odd, even) pairs folded into sin.
        cos = torch.cat([rotations[..., 0].repeat_interleave(2, -1)] * 2, -1)[:, :, None, :].to(dtype)
        sin = torch.stack((-rotations[..., 1], rotations[..., 1]), -1).flatten(-2)
        sin = torch.cat([sin] * 2, -1)[:, :, None, :].to(dtype)
        reference = apply_rope(qk.float(), rotations)
        low = rope_in_low_precision(qk, cos, sin)
        print(f"{dtype}: RoPE of q and k, ms: one call {median_ms(lambda: apply_rope(qk, rotations)):.1f}, "
              f"two calls {median_ms(lambda: (apply_rope(q, rotations), apply_rope(k, rotations))):.1f}, "
              f"real pairs in {dtype} {median_ms(lambda: rope_in_low_precision(qk, cos, sin)):.1f}; max error vs "
              f"float32: one call {(apply_rope(qk, rotations).float() - reference).abs().max():.4f}, real pairs "
              f"{(low.float() - reference).abs().max():.4f}")

        w12_output = torch.randn(BATCH, LENGTH, 2 * FFN).to(dtype)

        def out_of_place():
            gate, up = w12_output.clone().chunk(2, dim=-1)  # clone: a fresh w12 output, as in the model
            return F.silu(gate) * up

        def in_place():
            gate, up = w12_output.clone().chunk(2, dim=-1)
            return F.silu(gate, inplace=True).mul_(up)

        fresh = median_ms(lambda: w12_output.clone())
        print(f"{dtype}: SwiGLU elementwise, ms (the clone of {fresh:.1f} ms subtracted): out of place "
              f"{median_ms(out_of_place) - fresh:.1f}, in place {median_ms(in_place) - fresh:.1f}")


if __name__ == "__main__":
    main()
