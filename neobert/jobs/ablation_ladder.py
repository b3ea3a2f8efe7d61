"""The ablation ladder M0..M10 (paper Table 2 and Figure 1): its definition, the budgets that rescale it, the diff
of a step against its parent, and the record of a step's run (`StepResult`). The job that runs it is
`neobert.jobs.ablations`; the evaluation of a step, `neobert.jobs.ablation_eval`.

Each step is one change on top of its parent, the previous *kept* step: the tokenizer (M3) and packing (M6)
steps branch off and are reverted, so M4 starts from M2 and M7 from M5. The packaged config `ablations/mXX`
holds each step at the paper's scale, `inherit:`ing its parent and stating only its change; `LADDER` lists the
config keys each step changes, and `config_diff` (tested) proves that nothing else differs.

A budget (packaged `ablations/budgets/{tiny,small,paper}`, schema `AblationBudgetConfig`) maps the paper's
shapes, lengths and batch sizes to smaller ones. It is a function of the config, applied alike to a step and to
its parent, so a step's diff at any budget is a subset of its documented keys (it can become empty, e.g. M2's
data change when both corpora are the offline demo corpus; the results say so).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence


from neobert.config import ConfigError, config_path, load_config, merge_overrides, packaged_config_names
from neobert.config.ablations import AblationBudgetConfig
from neobert.config.pretrain import PretrainConfig
from neobert.model.config import NeoBERTConfig

BUDGETS = "ablations/budgets"  # packaged budget configs: ablations/budgets/<name>
MISSING = "<absent>"


# ---------------------------------------------------------------------------------------------- the ladder
@dataclass(frozen=True)
class AblationStep:
    step: str
    parent: Optional[str]  # the kept step it changes
    title: str
    changed_keys: tuple[str, ...]  # PretrainConfig leaves that differ from the parent, at the paper's scale
    carried_forward: bool  # False: reverted, the next step starts from this step's parent
    paper_glue_delta: str = ""  # the paper's reported effect, where it gives one


_SIZE_KEYS = ("model.overrides.num_hidden_layers", "model.overrides.hidden_size", "model.overrides.intermediate_size")

LADDER: tuple[AblationStep, ...] = (
    AblationStep("m00", None, "BERT-base-like baseline", (), True),
    AblationStep("m01", "m00", "RoPE + SwiGLU + RMSNorm",
                 ("model.overrides.position_encoding", "model.overrides.activation", "model.overrides.norm",
                  "model.overrides.norm_eps"), True),
    AblationStep("m02", "m01", "RefinedWeb data", ("data.source", "data.hub_config", "data.text_column"), True,
                 "+3.6%"),
    AblationStep("m03", "m02", "LLaMA BPE tokenizer", ("data.tokenizer",), False, "-2.1%"),
    AblationStep("m04", "m02", "AdamW + cosine decay",
                 ("optimizer.name", "optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay",
                  "scheduler.name", "scheduler.warmup_steps"), True),
    AblationStep("m05", "m04", "20% masking, all [MASK]", ("masking.rate", "masking.strategy"), True),
    AblationStep("m06", "m05", "sequence packing", ("data.packing",), False, "-2.9%"),
    AblationStep("m07", "m05", "250M parameters (16 x 1056)", _SIZE_KEYS, True, "+2.9%"),
    AblationStep("m08", "m07", "depth-width 28 x 768, same size", _SIZE_KEYS, True),
    AblationStep("m09", "m08", "batch 2M tokens", ("trainer.accumulate_grad_batches",), True),
    AblationStep("m10", "m09", "context 4,096",
                 ("model.overrides.max_length", "data.max_length", "trainer.accumulate_grad_batches"), True),
)
STEPS = {s.step: s for s in LADDER}


def parse_steps(spec: str) -> list[str]:
    """'m00..m10', 'm00,m03,m05' or a mix ('m00..m02,m05')."""
    names = list(STEPS)
    chosen: list[str] = []
    for part in (p.strip().lower() for p in spec.split(",") if p.strip()):
        if ".." in part:
            start, end = part.split("..")
            if start not in STEPS or end not in STEPS:
                raise ConfigError(f"--steps: unknown step in {part!r}; steps are {names}")
            chosen += names[names.index(start): names.index(end) + 1]
        elif part in STEPS:
            chosen.append(part)
        else:
            raise ConfigError(f"--steps: unknown step {part!r}; steps are {names}")
    return list(dict.fromkeys(chosen))


def step_config_path(step: str) -> Path:
    """The step's packaged config (`ablations/mXX`)."""
    if step not in STEPS:
        raise ConfigError(f"unknown ablation step {step!r}; steps are {list(STEPS)}")
    return config_path(f"ablations/{step}")


# ---------------------------------------------------------------------------------------------- budgets
def load_budget(name_or_path: str, overrides: Sequence[str] = ()) -> AblationBudgetConfig:
    """A budget file, or the name of a packaged one (`tiny`, `small`, `paper`)."""
    path = Path(name_or_path)
    if not path.is_file():
        try:
            path = config_path(f"{BUDGETS}/{name_or_path}")
        except ConfigError:
            known = sorted(n.removeprefix(f"{BUDGETS}/") for n in packaged_config_names() if n.startswith(BUDGETS))
            raise ConfigError(f"--budget {name_or_path!r}: no such budget file; known budgets: {known}") from None
    return load_config(AblationBudgetConfig, path, overrides)


def tokens_per_step(config: PretrainConfig) -> int:
    trainer = config.trainer
    return trainer.micro_batch_size * trainer.accumulate_grad_batches * trainer.num_devices * trainer.num_nodes * \
        config.data.max_length


def apply_budget(config: PretrainConfig, budget: AblationBudgetConfig,
                 corpora: Mapping[str, str] | None = None) -> PretrainConfig:
    """The step's config at the budget's scale. A pure function of the config: equal inputs map alike.
    `corpora`: the files `prepare_corpora` wrote, by name (without them a corpus stands as its name)."""
    config = copy.deepcopy(config)
    paper_tokens = tokens_per_step(config)
    model = NeoBERTConfig.from_preset(config.model.preset, **config.model.overrides)
    overrides = dict(config.model.overrides)
    if budget.shapes:
        key = f"{model.num_hidden_layers}x{model.hidden_size}"
        if key not in budget.shapes:
            raise ConfigError(f"budget {budget.name!r}: no entry for the model shape {key} in `shapes`")
        overrides.update(dataclasses.asdict(budget.shapes[key]))
    if budget.lengths:
        for what, length in (("model max_length", model.max_length), ("data.max_length", config.data.max_length)):
            if str(length) not in budget.lengths:
                raise ConfigError(f"budget {budget.name!r}: no entry for {what}={length} in `lengths`")
        overrides["max_length"] = budget.lengths[str(model.max_length)]
        config.data.max_length = budget.lengths[str(config.data.max_length)]
    config.model.overrides = overrides
    if budget.tokens_per_step:
        if str(paper_tokens) not in budget.tokens_per_step:
            raise ConfigError(f"budget {budget.name!r}: no entry for {paper_tokens} tokens per step in "
                              f"`tokens_per_step`")
        sequences = max(1, budget.tokens_per_step[str(paper_tokens)] // config.data.max_length)
        micro = min(budget.micro_batch_size or sequences, sequences)
        config.trainer.micro_batch_size = micro
        config.trainer.accumulate_grad_batches = max(1, sequences // micro)
    if budget.devices is not None:
        config.trainer.devices = budget.devices
    if budget.max_steps is not None:
        config.trainer.max_steps = budget.max_steps
    config.optimizer.lr *= budget.lr_scale
    if budget.warmup_steps is not None:
        config.scheduler.warmup_steps = min(config.scheduler.warmup_steps, budget.warmup_steps)
    if config.data.source in budget.data_sources:
        name = budget.data_sources[config.data.source]
        config.data.source = (corpora or {}).get(name, name)
        config.data.hub_config = None
        config.data.text_column = "content"
    if budget.pretrain_overrides:
        config = merge_overrides(config, [f"{key}={_yaml_value(value)}"
                                          for key, value in budget.pretrain_overrides.items()])
    return config


def _yaml_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else ("null" if value is None else str(value))


@functools.lru_cache(maxsize=None)
def paper_config(step: str) -> PretrainConfig:
    return load_config(PretrainConfig, step_config_path(step))


def load_step_config(step: str, budget: AblationBudgetConfig | None = None,
                     corpora: Mapping[str, str] | None = None, overrides: Sequence[str] = ()) -> PretrainConfig:
    """The step's PretrainConfig (a fresh copy), at the budget's scale when one is given."""
    config = copy.deepcopy(paper_config(step))
    if budget is not None:
        config = apply_budget(config, budget, corpora)
    if overrides:
        config = merge_overrides(config, overrides)
    return config


# ---------------------------------------------------------------------------------------------- diffs
def config_leaves(config: PretrainConfig) -> dict[str, Any]:
    """Every leaf of the config as dotted key -> value (lists are one leaf)."""
    tree = dataclasses.asdict(config)
    leaves: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            leaves[prefix] = node

    walk(tree, "")
    return leaves


def config_diff(parent: PretrainConfig, child: PretrainConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (parent value, child value) for every leaf that differs (absent keys show as <absent>)."""
    a, b = config_leaves(parent), config_leaves(child)
    return {k: (a.get(k, MISSING), b.get(k, MISSING)) for k in sorted(set(a) | set(b))
            if a.get(k, MISSING) != b.get(k, MISSING)}


# ---------------------------------------------------------------------------------------------- a step's result
@dataclass
class StepResult:
    """One run of the ladder: a step at one seed, and its scores under the budget's evaluation protocol."""

    step: str
    parent: Optional[str]
    title: str
    carried_forward: bool
    budget: str
    seed: int
    changed_keys: List[str]  # the documented change
    effective_changes: Dict[str, Any]  # the diff at this budget: key -> [parent value, step value]
    tokenizer: str = ""  # loss-like scores compare only between steps with the same tokenizer
    data_source: str = ""
    parameters: Optional[int] = None
    tokens_per_step: Optional[int] = None  # sequences x max_length (padding included)
    train_loss: Optional[float] = None  # at the step's own masking rate and strategy
    heldout_loss: Optional[float] = None  # the budget's fixed rate, all [MASK], the held-out documents
    heldout_accuracy: Optional[float] = None
    pseudo_perplexity: Optional[float] = None
    sts_zero_shot: Optional[float] = None  # STS Benchmark dev Spearman, mean pooling
    sts_tuned: Optional[float] = None  # after the budget's short contrastive fine-tune
    glue: Dict[str, float] = field(default_factory=dict)  # task -> main score (fraction)
    glue_score: Optional[float] = None  # mean over the GLUE subset
    export_dir: Optional[str] = None
    pretrain_seconds: Optional[float] = None
    eval_seconds: Optional[float] = None
    protocol: Dict[str, Any] = field(default_factory=dict)  # the evaluation settings these scores come from
    notes: List[str] = field(default_factory=list)


