"""`model.compile_scope`: the whole forward compiled against each encoder block compiled on its own (regional
compilation), and eager, in one process (docs/benchmarks.md). NeoBERTForMaskedLM of a preset (random
weights) on `rows` x `length` tokens packed with cu_seqlens, 20% of them masked and scored through `masked_index`,
forward + backward under bf16 autocast (the pretraining step). `blocks_head_eager` is compile_scope=blocks less
its compiled MLM head (`NeoBERTForMaskedLM.score_masked_rows` eager): what compiling the head adds.
Reported: the first step of each (the compilation: run with a fresh TORCHINDUCTOR_CACHE_DIR for cold figures), then
the training steps alternated (neobert/instruments/ab.py: eager, model, blocks, blocks_head_eager, eager, ...),
median, and dynamo's graph count (a recompilation would show there).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python scripts/bench/compile_scope_ab.py [rows] [length] [preset] [repeats]
"""

from __future__ import annotations

import copy
import sys

import torch
from torch._dynamo.utils import counters

from neobert.instruments.ab import alternate, device_label, seconds_per_call
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model.attention import cu_seqlens_of_rows


def main(rows: int = 2, length: int = 256, preset: str = "neobert", repeats: int = 5) -> None:
    torch.manual_seed(0)
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset(preset, attention_backend="varlen"))
    models = {name: copy.deepcopy(eager) for name in ("model", "blocks", "blocks_head_eager")}
    models = {"eager": eager, **models}
    models["model"].compile(dynamic=False, scope="model")
    models["blocks"].compile(dynamic=False, scope="blocks")
    models["blocks_head_eager"].compile(dynamic=False, scope="blocks")
    del models["blocks_head_eager"].score_masked_rows  # the compiled scoring: the class's eager method again
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, eager.config.vocab_size, (rows * length,), generator=generator)
    labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.2, ids, -100)
    batch = {"labels": labels, "masked_index": (labels != -100).nonzero().squeeze(1),
             "cu_seqlens": cu_seqlens_of_rows(rows, length), "max_seqlen": length}
    cpu = torch.device("cpu")

    def step(model: NeoBERTForMaskedLM) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, **batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    def seconds(model: NeoBERTForMaskedLM) -> float:
        return seconds_per_call(lambda: step(model), cpu, calls=1).seconds

    print(f"{preset}, {rows} x {length} tokens, {device_label(cpu)}, torch {torch.__version__}, median of {repeats} "
          f"samples of 1 step")
    for name, model in models.items():
        print(f"{name}: first step {seconds(model):.1f} s (compiles)", flush=True)
        step(model)  # the second call, where a guard can compile again (neobert/instruments/ab.py)
    graphs = counters["stats"]["unique_graphs"]
    medians, failed, _ = alternate({name: lambda model=model: seconds(model) for name, model in models.items()},
                                   repeats)
    if failed:  # every variant is a term of the ratios below
        raise RuntimeError(f"not measured: {failed}")
    for name, median in medians.items():
        print(f"{name}: median step {median:.3f} s ({rows} x {length} tokens; x{medians['eager'] / median:.2f} eager)")
    print(f"blocks / model step time: {medians['blocks'] / medians['model']:.3f}; blocks_head_eager / blocks: "
          f"{medians['blocks_head_eager'] / medians['blocks']:.3f}; dynamo graphs: {graphs} after two steps each, "
          f"{counters['stats']['unique_graphs']} after the warm-ups and timed steps")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(*(int(a) for a in arguments[:2]), *arguments[2:3], *(int(a) for a in arguments[3:4]))
