"""Data-pipeline throughput: tokens/s of one worker for tokenize + mask (+ pack), this suite's pipeline
against Hugging Face's `DataCollatorForLanguageModeling` doing the same work on the same documents in the
same process (neobert.eval.data_pipeline).

    python -m experiments.bench_data [--docs 3000] [--max-length 128] [--batch-size 32] [--repeats 3]
    python -m experiments.bench_data --packing [--docs 3000] [--max-length 128]   # packing efficiency per mode

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

from neobert.eval.data_pipeline import measure_data_pipeline, packing_report
from neobert.jobs.cli import add_debug_flag, run_cli


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--packing", action="store_true",
                        help="instead of speed: packing efficiency, cut documents and dropped tokens of data.packing "
                             "none / greedy / best_fit on the same documents")
    parser.add_argument("--open-rows", type=int, default=64, help="best_fit's data.packing_open_rows")
    parser.add_argument("--json", default=None, help="also write the results here")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.packing:
        report = packing_report(args.docs, args.max_length, args.batch_size, args.open_rows)
        corpus = report.pop("corpus")
        print(f"{corpus['documents']:,} documents, {corpus['tokens']:,} tokens, {corpus['longer_than_a_row']:,} longer "
              f"than a row of {args.max_length}")
        print(f"{'data.packing':12s} {'efficiency':>10s} {'rows':>8s} {'documents cut':>14s} {'tokens dropped':>15s}")
        for mode, row in report.items():
            print(f"{mode:12s} {row['packing_efficiency']:10.4f} {row['rows']:8,d} {row['documents_cut']:14,d} "
                  f"{row['tokens_dropped']:15,d}")
        report["corpus"] = corpus
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return report
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
