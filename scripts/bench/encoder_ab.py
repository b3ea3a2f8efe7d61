"""In-process A/B of the eager encoder's two non-matmul changes of issue 15 (docs/benchmarks.md): the `neobert`
preset, random weights, batch 8 x 512, inference, 2 threads; the variants' forwards interleaved (A, B, C, A, ...)
so that they share the machine's load, median reported.

* before: q and k rotated by one RoPE call each, SwiGLU out of place (the code before issue 15's work);
* rope: q and k rotated in one call;
* rope+swiglu: and SwiGLU in place in the w12 output (the model as it is).

    python scripts/bench/encoder_ab.py [repeats] [dtype]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from neobert.model import NeoBERT, NeoBERTConfig
from neobert.model.attention import apply_rope, attend
from neobert.model.modeling import EncoderBlock, SwiGLU


def block_with_two_rope_calls(self, x, layout, rope):
    q, k, v = self.qkv(self.attention_norm(x)).unflatten(-1, (self.num_heads, 3 * self.head_dim)).chunk(3, dim=-1)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    x = x + self.dropout(self.wo(attend(q, k, v, layout, 0.0).flatten(-2)))
    return x + self.dropout(self.ffn(self.ffn_norm(x)))


def swiglu_out_of_place(self, x):
    gate, up = self.w12(x).chunk(2, dim=-1)
    return self.w3(F.silu(gate) * up)


def main(repeats: int = 4, dtype: str = "float32") -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = NeoBERT(NeoBERTConfig.from_preset("neobert")).to(getattr(torch, dtype)).eval()
    ids = torch.randint(5, model.config.vocab_size, (8, 512))
    variants = {
        "before": (block_with_two_rope_calls, swiglu_out_of_place),
        "rope": (EncoderBlock.forward, swiglu_out_of_place),
        "rope+swiglu": (EncoderBlock.forward, SwiGLU.forward),
    }
    originals = (EncoderBlock.forward, SwiGLU.forward)
    outputs, times = {}, {name: [] for name in variants}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # round 0 warms up
            for name, (block_forward, swiglu_forward) in variants.items():
                EncoderBlock.forward, SwiGLU.forward = block_forward, swiglu_forward
                start = time.perf_counter()
                outputs[name] = model(ids).last_hidden_state
                if round_:
                    times[name].append(time.perf_counter() - start)
    EncoderBlock.forward, SwiGLU.forward = originals
    base = statistics.median(times["before"])
    for name, measured in times.items():
        step = statistics.median(measured)
        difference = (outputs[name].float() - outputs["before"].float()).abs().max()
        print(f"{name:12s} {8 * 512 / step:7.1f} tokens/s  {base / step:.3f}x before  "
              f"(max |output - before| {difference:.2e}; runs {', '.join(f'{t:.2f}' for t in measured)} s)")


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
