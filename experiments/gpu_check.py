"""Prove a GPU node in one command: a pretraining recipe's model alone (the encoder, and the model with its MLM head:
the ceiling), its real training loop under its own strategy and under the plain one (tokens/s, MFU, a validation, a
checkpoint), a resume, the export and its reload, and peak memory against the preflight's estimate; one table
(output_dir/gpu_check.md and .json).

    python -m experiments.gpu_check --config neobert --steps 50 data.source=/data/refinedweb/ \
        data.tokenizer=/models/bert-base-uncased
    python -m experiments.gpu_check --config demo --steps 20 --no-targets          # any machine, a CPU too

`key=value` arguments are the check's own keys (steps, warmup_steps, resume_steps, devices, plain_strategy,
ceiling_repeats, profile, profile_steps, speed_only, output_dir, overwrite, targets.loop_vs_ceiling,
targets.strategy_vs_plain, targets.enforce) or overrides of the recipe (any other key: data.source=...,
trainer.micro_batch_size=...). Exit status 1 when a stage failed or a ratio is under its target (targets are enforced
on CUDA unless targets.enforce=false; on a CPU only with targets.enforce=true). See docs/pretraining.md, "First GPU
run".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from neobert.config import flag_overrides, load_config
from neobert.config.gpu_check import GpuCheckConfig, split_overrides
from neobert.instruments.gpu_check import GpuCheckResult, run_gpu_check
from neobert.jobs.cli import add_debug_flag, run_cli


def parse_args(argv=None) -> GpuCheckConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the pretraining recipe: a packaged name (neobert, demo) or a YAML path "
                                         "(default: neobert)")
    parser.add_argument("--steps", type=int, help="optimizer steps of each training loop (default: 50)")
    parser.add_argument("--resume-steps", type=int, help="steps of the resumed run (default: 10)")
    parser.add_argument("--output-dir", help="where the stage runs and gpu_check.md/.json go (default: "
                                             "runs/gpu_check)")
    parser.add_argument("--no-targets", action="store_true",
                        help="report the ratios without failing on them (targets.enforce=false)")
    parser.add_argument("overrides", nargs="*", help="key=value: the check's keys, or the recipe's (passed through)")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow any flag
    args.overrides, recipe_overrides = split_overrides(args.overrides)
    overrides = flag_overrides(args, values=("config", "steps", "resume_steps", "output_dir"))
    if args.no_targets:
        overrides.append("targets.enforce=false")
    config = load_config(GpuCheckConfig, None, overrides)
    return dataclasses.replace(config, overrides=[*config.overrides, *recipe_overrides])


def main(argv=None) -> GpuCheckResult:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = run_gpu_check(parse_args(argv))
    if result.failures:
        raise SystemExit("gpu check FAILED: " + "; ".join(result.failures))  # exit status 1, the reasons on stderr
    return result


if __name__ == "__main__":
    sys.exit(run_cli(main))
