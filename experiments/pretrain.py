"""MLM pretraining: `python -m experiments.pretrain [--config configs/x.yaml] [key=value ...]`.

With no --config it runs the embedded demo (configs/demo.yaml): a small NeoBERT on CPython's documentation,
offline, on CPU, in a few minutes. `--pretokenize DIR` writes the config's documents as token-id shards for
`data.pretokenized_dir` instead of training.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from neobert.config import load_config
from neobert.lit.pretrain_config import PretrainConfig

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded demo)")
    parser.add_argument("--pretokenize", metavar="DIR", default=None,
                        help="tokenize the config's data into parquet shards under DIR and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    demo = args.config is None or Path(args.config).resolve() == DEMO_CONFIG
    config = load_config(PretrainConfig, args.config or DEMO_CONFIG, args.overrides)
    if demo:
        from neobert.data.demo_corpus import write_demo_corpus

        write_demo_corpus(config.data.source)

    if args.pretokenize:
        from neobert.data.pretraining import pretokenize
        from neobert.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.data.tokenizer, config_key="data.tokenizer")
        shards = pretokenize(config.data, tokenizer, args.pretokenize)
        print(f"wrote {len(shards)} shard(s) to {args.pretokenize}; set data.pretokenized_dir={args.pretokenize}")
        return Path(args.pretokenize)

    from neobert.lit.pretrain import run_pretraining

    return run_pretraining(config)


if __name__ == "__main__":
    main()
