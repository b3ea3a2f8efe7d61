"""torch.compile against eager, in one process (docs/benchmarks.md): our `neobert` preset and Hugging Face
BertModel (random weights), batch 8 x 512, inference, 2 threads, in `dtype`; per model: eager, compiled with one
static graph (what the throughput job times), compiled with dynamic shapes (what dynamo chose
after the batch-size search's second size before) and compiled with Inductor's freezing. Each model's forwards
alternated (neobert/instruments/ab.py: eager, static, dynamic, frozen, eager, ...) after two warm-ups that compile,
median reported.

    python scripts/bench/compile_ab.py [repeats] [dtype]
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModel, BertConfig

from neobert.instruments.ab import compare, device_label, seconds_per_call
from neobert.model import NeoBERT, NeoBERTConfig

BATCH = 8


def frozen(compiled):
    """Inductor's freezing (weights as constants, prepacked for oneDNN on CPU), an inference-only option: set while
    the first call compiles."""
    def call(ids):
        with torch._inductor.config.patch(freezing=True):
            return compiled(ids)
    return call


def main(repeats: int = 4, dtype: str = "bfloat16", *, preset: str = "neobert", bert: BertConfig | None = None,
         length: int = 512) -> None:
    """`preset`, `bert` (BERT-base's config when None) and `length`: smaller models for a quick check on CPU."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dtype_ = getattr(torch, dtype)
    ours = NeoBERT(NeoBERTConfig.from_preset(preset)).to(dtype_).eval()
    bert_model = AutoModel.from_config(bert or BertConfig(), attn_implementation="sdpa").to(dtype_).eval()
    ids = torch.randint(5, 30000, (BATCH, length))
    forwards = {
        "neobert": lambda ids: ours(ids).last_hidden_state,
        "bert-base": lambda ids: bert_model(input_ids=ids).last_hidden_state,
    }
    cpu = torch.device("cpu")
    print(f"Inference forward, {BATCH} x {length} {dtype}, {device_label(cpu)}, torch {torch.__version__}, "
          f"median of {repeats} samples of 1 call")

    def describe(forward, median: float, eager: float) -> str:
        return f"{BATCH * length / median:7.1f} tokens/s  {eager / median:.3f}x eager"

    with torch.inference_mode():
        for name, forward in forwards.items():  # each model's variants in an alternation of their own
            variants = {f"{name} eager": forward,
                        f"{name} compiled, static": torch.compile(forward, dynamic=False),
                        f"{name} compiled, dynamic": torch.compile(forward, dynamic=True),
                        f"{name} compiled, frozen": frozen(torch.compile(forward, dynamic=False))}
            print("\n".join(compare(variants, lambda run: seconds_per_call(lambda: run(ids), cpu, calls=1),
                                    describe, repeats, width=28)))


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
