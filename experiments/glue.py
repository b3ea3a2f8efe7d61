"""GLUE fine-tuning (NEOBERT_SPEC section 4).

    python -m experiments.glue --task rte [--model DIR|HUB_NAME|preset:tiny] [--config configs/glue/rte.yaml]
                               [--sweep] [key=value ...]

`--task all` runs every task (MNLI first, so RTE, MRPC and STS-B can start from it) and writes
`<output_dir>/glue_results.{json,md}` in the paper's Table 3 layout. Without `--config`, the task's
`configs/glue/<task>.yaml` is used. Keys: neobert.lit.glue.GlueConfig (e.g. `data.path=../glue optim.lr=3e-5`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from neobert.config import ConfigError, load_config
from neobert.data.glue import GLUE_TASKS
from neobert.lit.glue import ALL_TASKS, GlueConfig, run_all, run_task

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "glue"


def task_config(task: str, config_path: str | None, model: str | None, overrides: list[str]) -> GlueConfig:
    path = config_path or CONFIG_DIR / f"{task}.yaml"
    extra = [f"task={task}"] + ([f"model={model}"] if model else [])
    return load_config(GlueConfig, path, [*overrides, *extra])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=[*GLUE_TASKS, "all"])
    parser.add_argument("--model", help="our export dir, a local Hugging Face dir, a hub name, or preset:tiny")
    parser.add_argument("--config", help="YAML config (default: configs/glue/<task>.yaml)")
    parser.add_argument("--sweep", action="store_true", help="run the grid of `sweep.*` and report the median")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.task == "all":
        if args.config:
            raise ConfigError("--task all uses configs/glue/<task>.yaml for each task; pass key=value overrides "
                              "instead of --config")
        configs = {task: task_config(task, None, args.model, args.overrides) for task in ALL_TASKS}
        results = run_all(configs, sweep=args.sweep)
    else:
        results = run_task(task_config(args.task, args.config, args.model, args.overrides), sweep=args.sweep)
    print(json.dumps(results if args.task != "all" else {t: r["scores"] for t, r in results.items()}, indent=2))
    return results


if __name__ == "__main__":
    main()
