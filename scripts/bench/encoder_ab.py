"""In-process A/B of the eager encoder's non-matmul changes (docs/benchmarks.md): the `neobert` preset, random
weights, batch 8 x 512, inference, 2 threads; the variants' forwards alternated (neobert/instruments/ab.py: A, B,
C, A, ...) so that they share the machine's load, median reported. Each variant puts back older code for some parts of the model:

* before-15: q and k rotated by one RoPE call each, SwiGLU out of place, norms and RoPE through float32 (the code
  before RoPE's q and k were turned in one call);
* before-27: the code before the bf16/fp16 fast path: one RoPE call for q and k, SwiGLU in place; norms and RoPE
  still copy bf16/fp16 activations to float32 and back (identical to `now` in float32);
* now: the model as it is (in bf16/fp16, RMSNorm accumulates in float32 inside its reduction, RoPE runs in the
  activations' dtype).

    python scripts/bench/encoder_ab.py [repeats] [dtype]
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

from neobert.instruments.ab import compare, device_label, seconds_per_call
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


VARIANTS = {  # before-27 first: the reference of the ratios and output differences
    "before-27": dict(upcast=True),
    "before-15": dict(block=block_with_two_rope_calls, swiglu=swiglu_out_of_place, upcast=True),
    "now": {},
}
BATCH = 8


def main(repeats: int = 4, dtype: str = "float32", *, preset: str = "neobert", length: int = 512) -> None:
    """`preset` and `length`: a smaller model and batch for a quick check on CPU."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = NeoBERT(NeoBERTConfig.from_preset(preset)).to(getattr(torch, dtype)).eval()
    ids = torch.randint(5, model.config.vocab_size, (BATCH, length))
    cpu = torch.device("cpu")

    def output(patch: dict) -> torch.Tensor:
        with patched(**patch):
            return model(ids).last_hidden_state.float()

    def time_one(patch: dict):
        with patched(**patch):
            return seconds_per_call(lambda: model(ids), cpu, calls=1)

    def describe(patch: dict, median: float, base: float) -> str:
        with patched(**patch):
            conversions = dtype_conversions(lambda: model(ids))
        return (f"{BATCH * length / median:7.1f} tokens/s  {base / median:.3f}x before-27  (max |output - before-27| "
                f"{(output(patch) - reference).abs().max():.2e}; dtype conversions {conversions.count}, "
                f"{conversions.elements / 1e6:.1f}M elements)")

    print(f"Inference forward, {preset}, {BATCH} x {length} {dtype}, {device_label(cpu)}, torch {torch.__version__}, "
          f"median of {repeats} samples of 1 call")
    with torch.inference_mode():
        reference = output(VARIANTS["before-27"])
        print("\n".join(compare(VARIANTS, time_one, describe, repeats, width=10)))


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
