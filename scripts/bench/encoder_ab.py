"""In-process A/B of the eager encoder's non-matmul changes (docs/benchmarks.md): the `neobert` preset, random
weights, batch 8 x 512, inference, 2 threads; the variants' forwards interleaved (A, B, C, A, ...) so that they
share the machine's load, median reported. Each variant puts back older code for some parts of the model:

* before-15: q and k rotated by one RoPE call each, SwiGLU out of place, norms and RoPE through float32 (the code
  before issue 15's work);
* before-27: issue 15's code: one RoPE call for q and k, SwiGLU in place; norms and RoPE still copy bf16/fp16
  activations to float32 and back (identical to `now` in float32);
* now: the model as it is (in bf16/fp16, RMSNorm accumulates in float32 inside its reduction, RoPE runs in the
  activations' dtype; issue 27).

    python scripts/bench/encoder_ab.py [repeats] [dtype]
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from neobert.instruments.timing import dtype_conversions
from neobert.model import NeoBERT, NeoBERTConfig
from neobert.model import rope
from neobert.model.attention import attend
from neobert.model.layers import RMSNorm, SwiGLU
from neobert.model.modeling import EncoderBlock
from neobert.model.rope import apply_rope


def block_with_two_rope_calls(self, x, layout, rope):
    q, k, v = self.qkv(self.attention_norm(x)).unflatten(-1, (self.num_heads, 3 * self.head_dim)).chunk(3, dim=-1)
    one_vector = rope.rotations[..., : self.head_dim // 2, :].squeeze(-3)  # the tables of q alone
    q, k = apply_rope(q, one_vector), apply_rope(k, one_vector)
    x = x + self.dropout(self.wo(attend(q, k, v, layout, 0.0).flatten(-2)))
    return x + self.dropout(self.ffn(self.ffn_norm(x)))


def swiglu_out_of_place(self, x):
    gate, up = self.w12(x).chunk(2, dim=-1)
    return self.w3(F.silu(gate) * up)


@contextlib.contextmanager
def patched(block=None, swiglu=None, upcast=False):
    """Older code for the encoder block, SwiGLU, and (upcast) the norms and RoPE's float32 round trip."""
    saved = EncoderBlock.forward, SwiGLU.forward, RMSNorm.forward, rope._HALF
    EncoderBlock.forward = block or saved[0]
    SwiGLU.forward = swiglu or saved[1]
    if upcast:
        RMSNorm.forward, rope._HALF = nn.RMSNorm.forward, ()
    try:
        yield
    finally:
        EncoderBlock.forward, SwiGLU.forward, RMSNorm.forward, rope._HALF = saved


VARIANTS = {
    "before-15": dict(block=block_with_two_rope_calls, swiglu=swiglu_out_of_place, upcast=True),
    "before-27": dict(upcast=True),
    "now": {},
}


def main(repeats: int = 4, dtype: str = "float32") -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = NeoBERT(NeoBERTConfig.from_preset("neobert")).to(getattr(torch, dtype)).eval()
    ids = torch.randint(5, model.config.vocab_size, (8, 512))
    outputs, times = {}, {name: [] for name in VARIANTS}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # round 0 warms up
            for name, patch in VARIANTS.items():
                with patched(**patch):
                    start = time.perf_counter()
                    outputs[name] = model(ids).last_hidden_state
                    if round_:
                        times[name].append(time.perf_counter() - start)
    base = statistics.median(times["before-27"])
    for name, measured in times.items():
        step = statistics.median(measured)
        difference = (outputs[name].float() - outputs["before-27"].float()).abs().max()
        with patched(**VARIANTS[name]):
            conversions = dtype_conversions(lambda: model(ids))
        print(f"{name:10s} {8 * 512 / step:7.1f} tokens/s  {base / step:.3f}x before-27  "
              f"(max |output - before-27| {difference:.2e}; dtype conversions {conversions.count}, "
              f"{conversions.elements / 1e6:.1f}M elements; runs {', '.join(f'{t:.2f}' for t in measured)} s)")


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
