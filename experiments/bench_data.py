"""Data-pipeline throughput: tokens/s of one worker for tokenize + mask (+ pack), this suite's pipeline
against Hugging Face's `DataCollatorForLanguageModeling` doing the same work on the same documents in the
same process.

    python -m experiments.bench_data [--docs 3000] [--max-length 128] [--batch-size 32] [--repeats 3]

Both sides start from raw text and end with masked, padded (multiple of 8) int64 batches: ours through
`PretrainingStream`'s parts (DocumentTokenizer -> BatchBuilder -> MLMMasker), Hugging Face's through
`tokenizer(..., truncation=True)` -> `DataCollatorForLanguageModeling(mlm_probability=0.2,
mask_replace_prob=1.0, random_replace_prob=0.0, pad_to_multiple_of=8)`. Tokens counted are real (non-pad)
tokens of the batches produced. The corpus is the demo's (CPython documentation), cycled to `--docs`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

# Imported up front so that no timing includes an import.
from neobert.data.masking import MLMMasker
from neobert.data.pretraining import BatchBuilder, DocumentTokenizer
from transformers import DataCollatorForLanguageModeling


def run_ours(texts, tokenizer, data, masking, batch_size: int) -> int:
    masker = MLMMasker.from_tokenizer(tokenizer, masking.rate, masking.strategy, masking.pad_to_multiple_of)
    builder = BatchBuilder(masker, batch_size, data.max_length, data.packing, set(tokenizer.all_special_ids))
    tokenize, generator, tokens = DocumentTokenizer(tokenizer, "content"), torch.Generator().manual_seed(0), 0
    for start in range(0, len(texts), 1000):  # blocks, as the stream reads them
        for ids in tokenize({"content": texts[start : start + 1000]}, {}):
            builder.add(ids)
            while builder.ready():
                batch = builder.pop(generator)
                tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
    return tokens


def run_hf(texts, tokenizer, max_length: int, batch_size: int) -> int:
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.2, mask_replace_prob=1.0,
                                               random_replace_prob=0.0, pad_to_multiple_of=8, return_tensors="pt")
    tokens = 0
    for start in range(0, len(texts), 1000):
        encoded = tokenizer(texts[start : start + 1000], truncation=True, max_length=max_length,
                            return_special_tokens_mask=True)["input_ids"]
        for i in range(0, len(encoded) - batch_size + 1, batch_size):
            batch = collator([{"input_ids": ids} for ids in encoded[i : i + batch_size]])
            tokens += int(batch["attention_mask"].sum())
    return tokens


def best_rate(fn, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - start))
    return max(rates)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one worker's worth of CPU

    from neobert.data.demo_corpus import demo_documents
    from neobert.data.tokenizer import load_tokenizer
    from neobert.lit.pretrain_config import DataSection, MaskingSection

    texts = [d["content"] for d in itertools.islice(itertools.cycle(demo_documents()), args.docs)]
    tokenizer = load_tokenizer()
    masking = MaskingSection(rate=0.2, strategy="all_mask")
    truncated = DataSection(max_length=args.max_length, packing=False)
    packed = DataSection(max_length=args.max_length, packing=True)
    results = {
        "hf_collator_tokens_per_s": best_rate(lambda: run_hf(texts, tokenizer, args.max_length, args.batch_size), args.repeats),
        "ours_truncate_tokens_per_s": best_rate(lambda: run_ours(texts, tokenizer, truncated, masking, args.batch_size), args.repeats),
        "ours_pack_tokens_per_s": best_rate(lambda: run_ours(texts, tokenizer, packed, masking, args.batch_size), args.repeats),
    }
    results["ratio_truncate_vs_hf"] = results["ours_truncate_tokens_per_s"] / results["hf_collator_tokens_per_s"]
    results["ratio_pack_vs_hf"] = results["ours_pack_tokens_per_s"] / results["hf_collator_tokens_per_s"]
    print(f"{'pipeline (1 worker, 1 thread)':44s} tokens/s")
    print(f"{'HF tokenizer + DataCollatorForLanguageModeling':44s} {results['hf_collator_tokens_per_s']:,.0f}")
    print(f"{'ours, truncation':44s} {results['ours_truncate_tokens_per_s']:,.0f} "
          f"({results['ratio_truncate_vs_hf']:.2f}x)")
    print(f"{'ours, packing':44s} {results['ours_pack_tokens_per_s']:,.0f} ({results['ratio_pack_vs_hf']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
