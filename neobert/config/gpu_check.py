"""The schema of a GPU-node check (`python -m experiments.gpu_check --config neobert [--steps 50] key=value ...`):
a pretraining recipe, measured against its own model alone (with its MLM head), under its strategy and the plain one,
resumed and exported (neobert.instruments.gpu_check; docs/pretraining.md, "First GPU run").

Keys of this schema are the check's; every other `key=value` of the command line is an override of the recipe
(`data.source=...`, `trainer.micro_batch_size=...`), kept in `overrides` and applied to every stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from neobert.config.loader import require


@dataclass
class GpuCheckTargets:
    """The ratios a GPU node must reach. `enforce`: null = on CUDA only. On a CPU the ratios are reported but do not
    fail the check: there the data workers, Lightning's per-step work and the model share the same few cores (and
    other processes'), so a tiny CPU recipe's loop/ceiling says nothing about a GPU node."""

    enforce: Optional[bool] = None
    # the training loop's tokens/s (MFU where known) >= this x the model alone with its MLM head (what the loop runs)
    loop_vs_ceiling: float = 0.9
    strategy_vs_plain: float = 0.9  # the recipe's strategy (e.g. deepspeed_stage_2) >= this x the plain loop

    def validate(self, prefix: str = "targets") -> None:
        require(self.loop_vs_ceiling >= 0, f"{prefix}.loop_vs_ceiling", "must be >= 0 (0 = no target)")
        require(self.strategy_vs_plain >= 0, f"{prefix}.strategy_vs_plain", "must be >= 0 (0 = no target)")


@dataclass
class GpuCheckConfig:
    config: str = "neobert"  # the pretraining recipe: a packaged name or a YAML path
    overrides: List[str] = field(default_factory=list)  # key=value overrides of the recipe, for every stage
    steps: int = 50  # optimizer steps of each training loop
    warmup_steps: int = 10  # the loops' first steps, left out of tokens/s and MFU
    resume_steps: int = 10  # steps of the resumed run, from the loop's final checkpoint
    devices: Any = "auto"  # "auto": every CUDA GPU of the node (1 on a CPU); or a number (trainer.devices)
    plain_strategy: str = "auto"  # the comparison loop: "auto" = Lightning's auto on one device, ddp on several
    ceiling_repeats: int = 5  # timed forward+backward steps of each model alone (the median is reported)
    ceiling_warmup: int = 2  # untimed steps before them
    # torch.profiler over more steps of the model with its MLM head, and over the recipe's loop's profile_steps
    # optimizer steps after its warm-up (then left out of the loops' tokens/s: `timed_from`): Chrome traces and the
    # self time of their CUDA kernels (CPU operators on a CPU) by category, side by side in gpu_check.md
    profile: bool = False
    profile_steps: int = 3
    # Only what a kernel or compile variant changes: the ceiling rows (and the profile) and the recipe's loop; the plain
    # loop, the resume and the export are skipped (about a third of the time)
    speed_only: bool = False
    output_dir: str = "runs/gpu_check"  # stage runs in <output_dir>/recipe and /plain; gpu_check.md and .json
    overwrite: bool = False  # remove an earlier check's stage runs and reports from output_dir first
    targets: GpuCheckTargets = field(default_factory=GpuCheckTargets)

    @property
    def timed_from(self) -> int:
        """The loops' first step counted in their tokens/s and MFU: after the warm-up, and with profile=true after the
        profiled steps and the next one (whose interval holds the profiler's stop and the writing of its tables)."""
        return self.warmup_steps + (self.profile_steps + 1 if self.profile else 0)

    def validate(self) -> None:
        require(self.steps > 0, "steps", "must be positive")
        require(0 <= self.warmup_steps < self.steps, "warmup_steps", f"must be in [0, steps={self.steps})")
        require(self.resume_steps > 0, "resume_steps", "must be positive")
        devices = self.devices
        require(devices == "auto" or (str(devices).isdigit() and int(devices) > 0), "devices",
                f"must be 'auto' or a positive integer, got {devices!r}")
        require(bool(self.plain_strategy), "plain_strategy", "must be a Lightning strategy name or 'auto'")
        require(self.ceiling_repeats >= 1, "ceiling_repeats", "must be at least 1")
        require(self.ceiling_warmup >= 0, "ceiling_warmup", "must be >= 0")
        require(self.profile_steps >= 1, "profile_steps", "must be at least 1")
        require(all("=" in o for o in self.overrides), "overrides", "every override must look like key=value")
        self.targets.validate()


CHECK_KEYS = tuple(f.name for f in dataclasses.fields(GpuCheckConfig))


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(this schema's overrides, the recipe's): `steps=20`, `targets.loop_vs_ceiling=0.8` are the check's,
    `data.source=x.jsonl`, `trainer.strategy=ddp` the recipe's (output_dir is the check's: the stages' run
    directories are inside it)."""
    mine, recipe = [], []
    for override in overrides:
        key = override.partition("=")[0].strip()
        (mine if key.split(".")[0] in CHECK_KEYS else recipe).append(override)
    return mine, recipe
