"""torch.compile against eager, in one process (docs/benchmarks.md, issue 27): our `neobert` preset and Hugging Face
BertModel (random weights), batch 8 x 512, inference, 2 threads, in `dtype`; per model: eager, compiled with one
static graph (what the throughput job times since issue 27), compiled with dynamic shapes (what dynamo chose
after the batch-size search's second size before) and compiled with Inductor's freezing. Forwards interleaved (A, B, C, ...) after a warm-up that
compiles, median reported.

    python scripts/bench/compile_ab.py [repeats] [dtype]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import AutoModel, BertConfig

from neobert.model import NeoBERT, NeoBERTConfig


def frozen(compiled):
    """Inductor's freezing (weights as constants, prepacked for oneDNN on CPU), an inference-only option: set while
    the first call compiles."""
    def call(ids):
        with torch._inductor.config.patch(freezing=True):
            return compiled(ids)
    return call


def main(repeats: int = 4, dtype: str = "bfloat16") -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dtype_ = getattr(torch, dtype)
    ours = NeoBERT(NeoBERTConfig.from_preset("neobert")).to(dtype_).eval()
    bert = AutoModel.from_config(BertConfig(), attn_implementation="sdpa").to(dtype_).eval()
    ids = torch.randint(5, 30000, (8, 512))
    forwards = {
        "neobert": lambda ids: ours(ids).last_hidden_state,
        "bert-base": lambda ids: bert(input_ids=ids).last_hidden_state,
    }
    variants = {}
    for name, forward in forwards.items():
        variants[f"{name} eager"] = forward
        variants[f"{name} compiled, static"] = torch.compile(forward, dynamic=False)
        variants[f"{name} compiled, dynamic"] = torch.compile(forward, dynamic=True)
        variants[f"{name} compiled, frozen"] = frozen(torch.compile(forward, dynamic=False))
    times = {name: [] for name in variants}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # round 0 compiles and warms up
            for name, forward in variants.items():
                start = time.perf_counter()
                forward(ids)
                if round_:
                    times[name].append(time.perf_counter() - start)
    for name, measured in times.items():
        step = statistics.median(measured)
        eager = statistics.median(times[name.split()[0] + " eager"])
        print(f"{name:30s} {8 * 512 / step:7.1f} tokens/s  {eager / step:.3f}x eager  "
              f"(runs {', '.join(f'{t:.2f}' for t in measured)} s)")


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
