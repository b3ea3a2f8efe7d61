"""Convert a training checkpoint of the official NeoBERT repository (a plain `state_dict.pt`, optionally
with DDP/torch.compile prefixes or DeepSpeed's `module` wrapper) to the hub layout.

    python -m experiments.convert_official path/to/state_dict.pt out/neobert-hub [--preset neobert] [field=value ...]
"""

from __future__ import annotations

import argparse
import sys

from neobert.jobs.cli import add_debug_flag, run_cli
from neobert.jobs.export import convert_official


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("state_dict", help="the official trainer's state_dict.pt")
    parser.add_argument("output_dir", help="where to write config.json, model.safetensors and the tokenizer")
    parser.add_argument("--preset", default="neobert", help="model preset the checkpoint was trained with")
    parser.add_argument("--tokenizer", default="google-bert/bert-base-uncased")
    parser.add_argument("overrides", nargs="*", help="NeoBERTConfig fields, e.g. max_length=1024")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    if any("=" not in item for item in args.overrides):
        parser.error(f"overrides must look like field=value, got {[o for o in args.overrides if '=' not in o]}")
    fields = dict(item.split("=", 1) for item in args.overrides)
    convert_official(args.state_dict, args.output_dir, args.preset, args.tokenizer,
                     **{k: _parse(v) for k, v in fields.items()})
    print(f"wrote {args.output_dir}")


def _parse(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


if __name__ == "__main__":
    sys.exit(run_cli(main))
