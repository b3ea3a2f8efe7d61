"""The ablation ladder M0..M10 (paper Table 2 and Figure 1): its definition, the budgets that rescale it, and the
job that pretrains and evaluates every step (`python -m experiments.ablations`; docs/ablations.md).

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
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from safetensors import safe_open

from neobert.config import ConfigError, config_path, load_config, merge_overrides, packaged_config_names
from neobert.config.ablations import AblationBudgetConfig, GlueSubsetConfig
from neobert.config.glue import GlueConfig
from neobert.config.pretrain import PretrainConfig
from neobert.data.demo_corpus import write_demo_corpus, write_fallback_glue
from neobert.data.tokenizer import BERT_BASE_UNCASED_ALIASES, train_bpe_tokenizer
from neobert.eval.plots import final_value, plot_ablation_glue
from neobert.hub import hub_reachable
from neobert.jobs.glue import run_task
from neobert.jobs.pretrain import run_pretraining
from neobert.layout import (ABLATION_CORPUS, ABLATION_GLUE_DIR, ABLATION_GLUE_FALLBACK_DIR, ABLATION_GLUE_PLOT,
                            ABLATION_RESULTS_MD, ABLATION_TOKENIZERS_DIR, EXPORT_DIR, RESULTS_JSON, WEIGHTS_NAME,
                            metrics_csvs)
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


def apply_budget(config: PretrainConfig, budget: AblationBudgetConfig, corpus: str | None = None) -> PretrainConfig:
    """The step's config at the budget's scale. A pure function of the config: equal inputs map alike."""
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
    if budget.data_source is not None:
        config.data.source = corpus if budget.data_source == "demo" else budget.data_source
        config.data.hub_config = None
        config.data.text_column = "content"
    if budget.pretrain_overrides:
        config = merge_overrides(config, [f"{key}={_yaml_value(value)}"
                                          for key, value in budget.pretrain_overrides.items()])
    return config


def _yaml_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else ("null" if value is None else str(value))


@functools.lru_cache(maxsize=None)
def _paper_config(step: str) -> PretrainConfig:
    return load_config(PretrainConfig, step_config_path(step))


def load_step_config(step: str, budget: AblationBudgetConfig | None = None, corpus: str | None = None,
                     overrides: Sequence[str] = ()) -> PretrainConfig:
    """The step's PretrainConfig (a fresh copy), at the budget's scale when one is given."""
    config = copy.deepcopy(_paper_config(step))
    if budget is not None:
        config = apply_budget(config, budget, corpus)
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


# ---------------------------------------------------------------------------------------------- the runner
@dataclass
class StepResult:
    step: str
    parent: Optional[str]
    title: str
    carried_forward: bool
    budget: str
    changed_keys: List[str]  # the documented change
    effective_changes: Dict[str, Any]  # the diff at this budget: key -> [parent value, step value]
    parameters: Optional[int] = None
    train_loss: Optional[float] = None
    glue: Dict[str, float] = field(default_factory=dict)  # task -> main score (fraction)
    glue_score: Optional[float] = None  # mean over the GLUE subset
    export_dir: Optional[str] = None
    pretrain_seconds: Optional[float] = None
    glue_seconds: Optional[float] = None
    notes: List[str] = field(default_factory=list)


def run_ablations(steps: str, budget: str, budget_overrides: Sequence[str] = (), output_dir: str | None = None,
                  evaluate: bool = True, overrides: Sequence[str] = ()) -> tuple[list[StepResult], dict[str, Path]]:
    """The command line's job: `steps` as `parse_steps` reads them, a budget name or file with its overrides,
    PretrainConfig overrides for every step; the output directory defaults to runs/ablations/<budget name>.
    Returns the results and the paths of the files written."""
    chosen = parse_steps(steps)
    scaled = load_budget(budget, budget_overrides)
    output_dir = output_dir or f"runs/ablations/{scaled.name}"
    results = run_ladder(chosen, scaled, output_dir, evaluate=evaluate, overrides=overrides)
    return results, write_results(results, output_dir)


def run_ladder(steps: Sequence[str], budget: AblationBudgetConfig, output_dir: str | Path, evaluate: bool = True,
               overrides: Sequence[str] = ()) -> list[StepResult]:
    """Pretrains every step (through `neobert.jobs.pretrain.run_pretraining`), fine-tunes each checkpoint on the
    budget's GLUE subset (through `neobert.jobs.glue.run_task`) and writes results.json / results.md /
    glue_per_step.png under `output_dir`. A step whose export already exists is not retrained."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpus = str(write_demo_corpus(output_dir / ABLATION_CORPUS)) if budget.data_source == "demo" else None
    glue_path, glue_note = _glue_data_path(budget.glue, output_dir, corpus) if evaluate else (None, "")
    results = []
    for step in steps:
        definition = STEPS[step]
        config = load_step_config(step, budget, corpus, overrides)
        parent = load_step_config(definition.parent, budget, corpus, overrides) if definition.parent else None
        result = StepResult(step, definition.parent, definition.title, definition.carried_forward, budget.name,
                            list(definition.changed_keys),
                            {k: list(v) for k, v in config_diff(parent, config).items()} if parent else {})
        if parent is not None and not result.effective_changes:
            result.notes.append(f"no effective change at the {budget.name!r} budget (e.g. both data sources are "
                                f"the same offline corpus): this step repeats its parent")
        if config.data.tokenizer not in BERT_BASE_UNCASED_ALIASES and not Path(config.data.tokenizer).is_dir() \
                and not hub_reachable():
            bpe = train_bpe_tokenizer(config.data, budget.bpe_vocab_size,
                                      output_dir / ABLATION_TOKENIZERS_DIR / f"bpe-{budget.bpe_vocab_size}")
            result.notes.append(f"{config.data.tokenizer} is out of reach (hub unreachable): a byte-level BPE "
                                f"tokenizer ({budget.bpe_vocab_size} tokens) was trained with `tokenizers` on the "
                                f"same corpus instead ({bpe}); its MLM loss is over other units, not comparable")
            config.data.tokenizer = str(bpe)
        if corpus is not None:
            result.notes.append(f"data: the offline demo corpus ({corpus}), not {_paper_config(step).data.source}")
        config.output_dir = str(output_dir / step)
        config.export_dir = str(output_dir / step / EXPORT_DIR)
        result.export_dir = config.export_dir
        export = Path(config.export_dir)
        started = time.perf_counter()
        if not (export / WEIGHTS_NAME).is_file():
            config.resume = True
            run_pretraining(config)
            result.pretrain_seconds = round(time.perf_counter() - started, 1)
        result.parameters = _count_parameters(export)
        csvs = metrics_csvs(config.output_dir)
        result.train_loss = final_value(csvs, "train/loss") if csvs else None
        if evaluate:
            started = time.perf_counter()
            result.glue = evaluate_glue(export, budget.glue, glue_path, output_dir / step / ABLATION_GLUE_DIR)
            result.glue_score = sum(result.glue.values()) / len(result.glue) if result.glue else None
            result.glue_seconds = round(time.perf_counter() - started, 1)
            if glue_note:
                result.notes.append(glue_note)
        results.append(result)
        write_results(results, output_dir)  # after every step: a long ladder can be read while it runs
    return results


def shared_glue_dir() -> Path | None:
    """$NEOBERT_SHARED_DATA/glue (unset: ../shared/data/glue from the working directory) when it holds RTE."""
    shared = os.environ.get("NEOBERT_SHARED_DATA")
    root = (Path(shared) if shared else Path.cwd().parent / "shared" / "data") / "glue"
    return root if (root / "rte").is_dir() else None


def _glue_data_path(glue: GlueSubsetConfig, output_dir: Path, corpus: str | None) -> tuple[str | None, str]:
    if glue.data_path != "auto":
        return glue.data_path, ""
    shared = shared_glue_dir()
    if shared is not None:
        steps = f"{glue.max_train_steps} steps" if glue.max_train_steps else "full"
        return str(shared), (f"GLUE: local files {shared} ({steps} fine-tuning on "
                             f"{glue.max_train_examples or 'all'} training examples)")
    corpus = corpus or str(write_demo_corpus(output_dir / ABLATION_CORPUS))
    fallback = write_fallback_glue(corpus, output_dir / ABLATION_GLUE_FALLBACK_DIR)
    return str(fallback), (f"GLUE: no GLUE files here; scored on the built-in fallback pair task built from the "
                           f"demo corpus ({fallback}/rte), not on RTE")


def evaluate_glue(export_dir: str | Path, glue: GlueSubsetConfig, data_path: str | None, output_dir: Path) -> dict:
    """Main score (a fraction) per task of the subset, from a short fine-tune of the checkpoint."""
    scores = {}
    for task in glue.tasks:
        config = GlueConfig(task=task, model=str(export_dir), output_dir=str(output_dir))
        config.data.path = data_path
        config.data.batch_size = glue.batch_size
        config.data.max_length = glue.max_length
        config.data.max_train_examples = glue.max_train_examples
        config.data.max_eval_examples = glue.max_eval_examples
        config.optimizer.lr = glue.lr
        config.trainer.seed = glue.seed
        config.logging.progress_bar = False
        if glue.max_train_steps:
            config.trainer.max_steps = glue.max_train_steps
            config.trainer.eval_every_n_steps = max(1, glue.max_train_steps // 3)
        summary = run_task(config)
        scores[task] = float(summary["scores"]["score"])
    return scores


def _count_parameters(export: Path) -> int | None:
    path = export / WEIGHTS_NAME
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


# ---------------------------------------------------------------------------------------------- results
def write_results(results: Sequence[StepResult], output_dir: str | Path) -> dict[str, Path]:
    output_dir = Path(output_dir)
    rows = [dataclasses.asdict(r) for r in results]
    paths = {"json": output_dir / RESULTS_JSON, "markdown": output_dir / ABLATION_RESULTS_MD}
    paths["json"].write_text(json.dumps(rows, indent=2, default=str) + "\n")
    paths["markdown"].write_text(results_markdown(rows) + "\n")
    if any(r["glue_score"] is not None for r in rows):
        paths["plot"] = plot_ablation_glue(rows, output_dir / ABLATION_GLUE_PLOT)
    return paths


def read_results(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / RESULTS_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m experiments.ablations` first")
    return json.loads(path.read_text())


def results_markdown(rows: Sequence[dict]) -> str:
    tasks = sorted({t for r in rows for t in r["glue"]})
    header = ("| step | change | parent | kept | params | MLM loss | " + " | ".join(tasks) +
              (" | " if tasks else "") + "GLUE subset | vs parent |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    by_step = {r["step"]: r for r in rows}
    for r in rows:
        parent = by_step.get(r["parent"]) if r["parent"] else None
        delta = "" if not parent or parent["glue_score"] is None or r["glue_score"] is None else \
            f"{100 * (r['glue_score'] - parent['glue_score']):+.1f}"
        cells = [r["step"].upper(), r["title"], (r["parent"] or "").upper(), "yes" if r["carried_forward"] else "no",
                 f"{r['parameters'] / 1e6:.2f}M" if r["parameters"] else "n/a",
                 f"{r['train_loss']:.3f}" if r["train_loss"] is not None else "n/a"]
        cells += [f"{100 * r['glue'][t]:.1f}" if t in r["glue"] else "n/a" for t in tasks]
        cells += [f"{100 * r['glue_score']:.1f}" if r["glue_score"] is not None else "n/a", delta]
        lines.append("| " + " | ".join(cells) + " |")
    steps_of: dict[str, list[str]] = {}
    for r in rows:
        for note in r["notes"]:
            steps_of.setdefault(note, []).append(r["step"].upper())
    if steps_of:
        lines += ["", "Notes:"]
        for note, steps in steps_of.items():
            where = "all steps" if len(steps) == len(rows) > 1 else ", ".join(steps)
            lines.append(f"- {where}: {note}")
    return "\n".join(lines)
