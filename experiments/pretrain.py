"""MLM pretraining: `python -m experiments.pretrain [--config NAME_OR_PATH] [key=value ...]`.

With no --config it runs the embedded demo (the packaged `demo` config): a small NeoBERT on CPython's
documentation, offline, on CPU, in a few minutes. A config is a YAML path or a packaged name (`neobert`,
`neobert-4096`, `ablations/m05`). `--pretokenize DIR` writes the config's documents as token-id shards for
`data.pretokenized_dir` instead of training. A recipe with `phases:` runs them all in order, resuming where it
stopped; `--phase NAME` reruns from the start of one. `--preflight` builds everything a GPU run builds except CUDA and
prints one report (strategy, DeepSpeed config, batch arithmetic, shards, memory, attention kernel, MFU peak),
refusing what would crash: e.g. `--config neobert --preflight trainer.devices=8 trainer.num_nodes=1`.
Keys and recipes: docs/pretraining.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from neobert.config import ConfigError
from neobert.instruments.preflight import DEFAULT_GPU, run_preflight
from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.phases import run_phases
from neobert.jobs.pretrain import load_pretrain_config, run_pretokenize, run_pretraining


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML path or packaged config name (default: demo)")
    parser.add_argument("--pretokenize", metavar="DIR", default=None,
                        help="tokenize the config's data into parquet shards under DIR and exit")
    parser.add_argument("--preflight", action="store_true",
                        help="check the run for its GPUs (trainer.devices x trainer.num_nodes) and report; no training")
    parser.add_argument("--gpu", default=DEFAULT_GPU,
                        help=f"the GPU the preflight plans for, as torch names it (default: {DEFAULT_GPU!r})")
    parser.add_argument("--phase", metavar="NAME", default=None,
                        help="a phased recipe: rerun from the start of phase NAME (from the previous phase's final "
                             "checkpoint) into output_dir/from-NAME")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_pretrain_config(args.config, args.overrides)
    if args.preflight:
        run_preflight(config, args.gpu)
        return Path(config.output_dir)
    if args.pretokenize:
        shards = run_pretokenize(config, args.pretokenize)
        print(f"wrote {len(shards)} shard(s) to {args.pretokenize}; set data.pretokenized_dir={args.pretokenize}")
        return Path(args.pretokenize)
    if config.phases:
        return run_phases(config, args.phase)[-1]
    if args.phase:
        raise ConfigError(f"--phase {args.phase!r}: this config has no phases")
    return run_pretraining(config)


if __name__ == "__main__":
    sys.exit(run_cli(main))
