"""Data-pipeline throughput: tokens/s of one worker for tokenize + mask (+ pack), this suite's pipeline
against Hugging Face's `DataCollatorForLanguageModeling` doing the same work on the same documents in the
same process (neobert.eval.data_pipeline).

    python -m experiments.bench_data [--docs 3000] [--max-length 128] [--batch-size 32] [--repeats 3]

Both sides start from raw text and end with masked, padded (multiple of 8) int64 batches: ours through
`PretrainingStream`'s parts (DocumentTokenizer -> BatchBuilder -> MLMMasker), Hugging Face's through
`tokenizer(..., truncation=True)` -> `DataCollatorForLanguageModeling(mlm_probability=0.2,
mask_replace_prob=1.0, random_replace_prob=0.0, pad_to_multiple_of=8)`. Tokens counted are real (non-pad)
tokens of the batches produced. The corpus is the demo's (CPython documentation), cycled to `--docs`.
"""

from __future__ import annotations

import argparse
import json
import sys

from neobert.eval.data_pipeline import measure_data_pipeline
from neobert.jobs.cli import add_debug_flag, run_cli


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    results = measure_data_pipeline(args.docs, args.max_length, args.batch_size, args.repeats)
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
    sys.exit(run_cli(main))
