"""Export a pretraining checkpoint in the official hub layout, with its tokenizer:
`python -m experiments.export runs/neobert/checkpoints/last.ckpt out/neobert`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.export import export_from_checkpoint


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", help="a Lightning .ckpt written by experiments.pretrain (or a DeepSpeed dir)")
    parser.add_argument("export_dir", help="output directory (config.json, model.safetensors, tokenizer files)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    out = export_from_checkpoint(args.checkpoint, args.export_dir)
    print(f"exported {args.checkpoint} -> {out}")
    return out


if __name__ == "__main__":
    sys.exit(run_cli(main))
