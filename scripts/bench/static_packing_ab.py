"""The training step (forward + backward through `MLMPretrainingModule`, no optimizer) on best-fit packed batches,
eager against torch.compile, in one process (data.static_shapes): eager on the unpadded batches (the
default without compile), eager on the static batches (what the padding costs), compiled (Inductor) on the static
batches (one graph) and compiled on the unpadded ones (what compile did before: a recompile, then a dynamic graph); and eager
on the static batches with their zero-length filler documents given to the model, as only CUDA graphs still do.
The batches are the real stream's (the demo corpus, micro-batch x max_length, best fit); variants alternated
(neobert/instruments/ab.py: a sample is one pass over the batches, A, B, C, D per round) after two warm-up passes
that compile; the median over the rounds, and the graphs each compiled.

    python scripts/bench/static_packing_ab.py [preset] [rounds] [micro_batch] [max_length]
"""

from __future__ import annotations

import copy
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch._inductor.compile_fx import compile_fx

from neobert.config.pretrain import MaskingConfig, PretrainConfig, PretrainDataConfig
from neobert.data.demo_corpus import demo_documents
from neobert.data.pretraining import PretrainingStream
from neobert.data.stream_state import DATA_STATE_KEY
from neobert.data.tokenizer import load_tokenizer
from neobert.instruments.ab import alternate, seconds_per_call
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.model import NeoBERTConfig

BATCHES = 20  # distinct batches, cycled over the rounds


def stream_batches(corpus: Path, tokenizer, static_shapes: str, micro_batch: int, max_length: int) -> list[dict]:
    data = PretrainDataConfig(source=str(corpus), max_length=max_length, shuffle_buffer=200, num_workers=0,
                              packing="best_fit", static_shapes=static_shapes)
    batches = list(itertools.islice(iter(PretrainingStream(data, MaskingConfig(), tokenizer, micro_batch)), BATCHES))
    for batch in batches:
        batch.pop(DATA_STATE_KEY)
    return batches


def main(preset: str = "mini", rounds: int = 10, micro_batch: int = 8, max_length: int = 128) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    corpus = Path(tempfile.mkdtemp()) / "demo.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in demo_documents()))
    batches = {"unpadded": stream_batches(corpus, tokenizer, "false", micro_batch, max_length),
               "static": stream_batches(corpus, tokenizer, "true", micro_batch, max_length)}
    config = NeoBERTConfig.from_preset(preset, vocab_size=len(tokenizer), max_length=max_length,
                                       attention_backend="varlen")
    eager = MLMPretrainingModule(PretrainConfig(), config, tokenizer).train()
    graphs: dict[str, int] = {}

    def compiled(name: str) -> MLMPretrainingModule:
        def counting_inductor(graph_module, example_inputs):
            graphs[name] = graphs.get(name, 0) + 1
            return compile_fx(graph_module, example_inputs)

        module = copy.deepcopy(eager)
        module.config.model.compile = True  # as a compiled run's module: it marks the document count dynamic
        module.model.compile(backend=counting_inductor)
        return module

    with_filler = copy.deepcopy(eager)  # the zero-length filler documents reach the model, as under CUDA graphs
    with_filler.config.model.compile_mode = "reduce-overhead"
    variants = {"eager, unpadded": (eager, "unpadded"), "eager, static": (eager, "static"),
                "eager, static+filler": (with_filler, "static"),
                "compiled, static": (compiled("compiled, static"), "static"),
                "compiled, unpadded": (compiled("compiled, unpadded"), "unpadded")}
    real_tokens = statistics.mean(batch["input_ids"].numel() for batch in batches["unpadded"])

    def seconds_per_step(variant) -> float:
        """One pass over the variant's batches: seconds per training step."""
        module, kind = variant
        remaining = iter(batches[kind])

        def step():
            module.model.zero_grad(set_to_none=True)
            module(next(remaining)).loss.backward()

        return seconds_per_call(step, torch.device("cpu"), calls=len(batches[kind])).seconds

    medians, failed, _ = alternate({name: lambda variant=variant: seconds_per_step(variant)
                                    for name, variant in variants.items()}, rounds)
    if failed:  # every variant is a term of the ratios below
        raise RuntimeError(f"not measured: {failed}")
    print(f"{preset}, {micro_batch} x {max_length} best fit, {real_tokens:.0f} real tokens per batch on average, "
          f"{rounds} rounds of {BATCHES} batches, torch {torch.__version__}, 2 threads")
    for name, step in medians.items():
        print(f"{name:22s} {1000 * step:8.1f} ms/step  {real_tokens / step:8.0f} real tokens/s  "
              f"{medians['eager, unpadded'] / step:.3f}x eager unpadded  {medians['eager, static'] / step:.3f}x "
              f"eager static  graphs {graphs.get(name, '-')}")


if __name__ == "__main__":
    main(*(a if i == 0 else int(a) for i, a in enumerate(sys.argv[1:])))
