"""Export a pretraining checkpoint in the official hub layout, with its tokenizer:

    python -m experiments.export runs/neobert/checkpoints/last.ckpt out/neobert
    python -m experiments.export runs/neobert out/neobert-avg3 --average last:3     # mean of the last 3 checkpoints
    python -m experiments.export runs/neobert/checkpoints/last.ckpt out/neobert-ema --weights ema
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.export import WEIGHT_SETS, export_from_checkpoint, select_checkpoints


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint written by experiments.pretrain (a .ckpt file, or a "
                                           "DeepSpeed or fsdp2 checkpoint directory); with --average last:N, the "
                                           "run's output_dir")
    parser.add_argument("export_dir", help="output directory (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--average", nargs="+", metavar="CKPT", default=(),
                        help="export the mean of several checkpoints' weights: last:N (the N highest-step checkpoints "
                             "of the run) or checkpoint paths; averaging.json records which")
    parser.add_argument("--weights", choices=WEIGHT_SETS, default="raw",
                        help="the trained weights (raw) or their exponential moving average (ema, trainer.ema)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty export_dir as a whole (refused otherwise)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    sources = select_checkpoints(args.checkpoint, args.average) if args.average else ()
    out = export_from_checkpoint(args.checkpoint, args.export_dir, weights=args.weights, average=sources,
                                 overwrite=args.overwrite)
    what = f"the mean of {', '.join(str(p) for p in sources)}" if sources else args.checkpoint
    print(f"exported {what} ({args.weights} weights) -> {out}")
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
