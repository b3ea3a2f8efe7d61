"""`model.compile_scope`: the whole forward compiled against each encoder block compiled on its own (regional
compilation), and eager, in one process (docs/benchmarks.md, issue 34). NeoBERTForMaskedLM of a preset (random
weights) on `rows` x `length` tokens packed with cu_seqlens, 20% of them masked and scored through `masked_index`,
forward + backward under bf16 autocast (the pretraining step). `blocks_head_eager` is compile_scope=blocks less
its compiled MLM head (`NeoBERTForMaskedLM.score_masked_rows` eager): what compiling the head adds.
Reported: the first step of each (the compilation: run with a fresh TORCHINDUCTOR_CACHE_DIR for cold figures), then
the training steps interleaved (eager, model, blocks, blocks_head_eager, eager, ...), median, and dynamo's graph
count (a recompilation would show there).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python scripts/bench/compile_scope_ab.py [rows] [length] [preset] [repeats]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

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

    def step(model: NeoBERTForMaskedLM) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, **batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name, model in models.items():
        print(f"{name}: first step {step(model):.1f} s (compiles)", flush=True)
        step(model)
    graphs = counters["stats"]["unique_graphs"]
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            times[name].append(step(model))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name}: median step {median:.3f} s ({rows} x {length} tokens; x{medians['eager'] / median:.2f} eager)")
    print(f"blocks / model step time: {medians['blocks'] / medians['model']:.3f}; blocks_head_eager / blocks: "
          f"{medians['blocks_head_eager'] / medians['blocks']:.3f}; dynamo graphs: {graphs} after the warm-up, "
          f"{counters['stats']['unique_graphs']} after the timed steps")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(*(int(a) for a in arguments[:2]), *arguments[2:3], *(int(a) for a in arguments[3:4]))
