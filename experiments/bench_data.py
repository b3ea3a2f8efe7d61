"""Data-pipeline throughput: tokens/s of one worker for tokenize + mask (+ pack), this suite's pipeline
against Hugging Face's `DataCollatorForLanguageModeling` doing the same work on the same documents in the
same process (neobert.instruments.bench_data, its measurements neobert.instruments.data_pipeline).

    python -m experiments.bench_data [--docs 3000] [--max-length 128] [--batch-size 32] [--repeats 3]
    python -m experiments.bench_data --packing [--docs 3000] [--max-length 128]   # packing efficiency per mode
    python -m experiments.bench_data --stream CORPUS [--streams 32] [--packing-mode best_fit]   # a whole stream

Both sides start from raw text and end with masked, padded (multiple of 8) int64 batches: ours through
`PretrainingStream`'s parts (DocumentTokenizer -> BatchBuilder -> MLMMasker), Hugging Face's through
`tokenizer(..., truncation=True)` -> `DataCollatorForLanguageModeling(mlm_probability=0.2,
mask_replace_prob=1.0, random_replace_prob=0.0, pad_to_multiple_of=8)`. Tokens counted are real (non-pad)
tokens of the batches produced. The corpus is the demo's (CPython documentation), cycled to `--docs`.
"""

from __future__ import annotations

import argparse
import sys

from neobert.instruments.bench_data import bench_packing, bench_speed, bench_stream
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
    parser.add_argument("--stream", metavar="CORPUS", default=None,
                        help="instead: one reader's whole pretraining stream over this local corpus (documents/s, "
                             "ms per batch after --docs // --batch-size batches) and its checkpointed position")
    parser.add_argument("--streams", type=int, default=0, help="--stream: data.streams (0: one)")
    parser.add_argument("--packing-mode", default="none", help="--stream: data.packing")
    parser.add_argument("--json", default=None, help="also write the results here")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.stream:
        return bench_stream(args.stream, max(1, args.docs // args.batch_size), args.max_length, args.batch_size,
                            args.packing_mode, args.streams, args.json)
    if args.packing:
        return bench_packing(args.docs, args.max_length, args.batch_size, args.open_rows, args.json)
    return bench_speed(args.docs, args.max_length, args.batch_size, args.repeats, args.json)


if __name__ == "__main__":
    sys.exit(run_cli(main))
