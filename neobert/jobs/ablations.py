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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from safetensors import safe_open

from neobert.config import ConfigError, config_path, load_config, merge_overrides, packaged_config_names
from neobert.config.ablations import AblationBudgetConfig, GlueSubsetConfig, StsProbeConfig
from neobert.config.contrastive import ContrastiveConfig
from neobert.config.glue import GlueConfig
from neobert.config.pretrain import PretrainConfig
from neobert.data.backbone import load_backbone
from neobert.data.demo_corpus import write_demo_corpus, write_fallback_glue
from neobert.data.offline_corpus import write_offline_corpus
from neobert.data.tokenizer import BERT_BASE_UNCASED_ALIASES, train_tokenizer
from neobert.eval.heldout import heldout_mlm_loss, heldout_pseudo_perplexity
from neobert.eval.ladder_stats import LADDER_METRICS, summarize_ladder, summary_markdown
from neobert.eval.plots import final_value, plot_ablation_steps
from neobert.eval.pseudo_perplexity import load_model_and_tokenizer
from neobert.hub import hub_reachable
from neobert.jobs.contrastive import run_contrastive, sts_scores
from neobert.jobs.glue import run_task
from neobert.jobs.pretrain import run_pretraining
from neobert.layout import (ABLATION_CORPORA_DIR, ABLATION_GLUE_DIR, ABLATION_GLUE_FALLBACK_DIR, ABLATION_HELDOUT,
                            ABLATION_RESULTS_MD, ABLATION_RUN_ROW, ABLATION_STS_DIR, ABLATION_TOKENIZERS_DIR,
                            EXPORT_DIR, RESULTS_JSON, STS_ZERO_SHOT_DIR, WEIGHTS_NAME, ablation_figure, metrics_csvs,
                            write_atomically)
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
def _paper_config(step: str) -> PretrainConfig:
    return load_config(PretrainConfig, step_config_path(step))


def load_step_config(step: str, budget: AblationBudgetConfig | None = None,
                     corpora: Mapping[str, str] | None = None, overrides: Sequence[str] = ()) -> PretrainConfig:
    """The step's PretrainConfig (a fresh copy), at the budget's scale when one is given."""
    config = copy.deepcopy(_paper_config(step))
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


# ---------------------------------------------------------------------------------------------- the runner
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
    """Pretrains every step once per seed of the budget (through `neobert.jobs.pretrain.run_pretraining`), scores
    each checkpoint with the budget's protocol (held-out MLM loss and pseudo-perplexity, STS probe, GLUE subset)
    and writes results.json / results.md / the Figure 1 plots under `output_dir` after every run. Seed by seed,
    so the whole ladder at one seed comes first. Resumable: a finished run (its export and its scores under the
    same protocol) is read back, an interrupted one continues from its last checkpoint."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpora = prepare_corpora(budget, output_dir)
    glue_path, glue_note = _glue_data_path(budget.glue, output_dir) if evaluate and budget.glue.tasks else (None, "")
    sts_dir, sts_note = _sts_data_dir(budget.sts) if evaluate else (None, "")
    protocol = evaluation_protocol(budget, corpora.get(HELDOUT), sts_dir) if evaluate else {}
    results = []
    for seed in budget.seeds:
        for step in steps:
            result = run_step(step, seed, budget, corpora, output_dir, overrides, protocol)
            if evaluate and not result.protocol:
                started = time.perf_counter()
                evaluate_step(result, budget, corpora.get(HELDOUT), sts_dir, glue_path,
                              Path(result.export_dir).parent, protocol)
                result.eval_seconds = round(time.perf_counter() - started, 1)
                result.notes += [n for n in (sts_note, glue_note) if n]
                (Path(result.export_dir).parent / ABLATION_RUN_ROW).write_text(
                    json.dumps(dataclasses.asdict(result), indent=2) + "\n")
            results.append(result)
            write_results(results, output_dir)  # after every run: a long ladder can be read while it runs
    return results


HELDOUT = "heldout"  # the key of the held-out documents in `prepare_corpora`'s answer


def prepare_corpora(budget: AblationBudgetConfig, output_dir: Path) -> dict[str, str]:
    """Writes the corpora the budget names (once) and returns name -> the file each step trains on, plus
    `HELDOUT` -> the held-out documents when the budget scores on them. The held-out documents are the first
    `heldout.documents` of their corpus; the training file of that corpus is the rest, so no step sees them."""
    directory = output_dir / ABLATION_CORPORA_DIR
    names = set(budget.data_sources.values())
    if budget.heldout.documents:
        names.add(budget.heldout.source)
    full = {}
    for name in sorted(names):
        if name == "demo":
            full[name] = write_demo_corpus(directory / "demo.jsonl")
        elif name == "offline":
            full[name] = Path(write_offline_corpus(directory / "offline.jsonl", shuffle_seed=0)["path"])
        elif Path(name).is_file():
            full[name] = Path(name)
        else:
            key = "heldout.source" if name == budget.heldout.source else "data_sources"
            raise ConfigError(f"budget {budget.name!r}: {key} names {name!r}, which is neither demo, offline nor "
                              f"an existing file")
    corpora = {name: str(path) for name, path in full.items()}
    if budget.heldout.documents:
        source = budget.heldout.source
        heldout, rest = directory / ABLATION_HELDOUT, directory / f"{Path(full[source]).stem}.train.jsonl"
        split_heldout(full[source], budget.heldout.documents, heldout, rest)
        corpora[source], corpora[HELDOUT] = str(rest), str(heldout)
    return corpora


def split_heldout(corpus: Path, documents: int, heldout: Path, rest: Path) -> None:
    """Writes the first `documents` lines of a .jsonl corpus to `heldout` and the others to `rest` (once)."""
    if heldout.is_file() and rest.is_file():
        return
    if corpus.suffix != ".jsonl":
        raise ConfigError(f"heldout.source: {corpus} must be a .jsonl file (one document per line) to split")
    with corpus.open(encoding="utf-8") as f:
        lines = f.readlines()
    if len(lines) <= documents:
        raise ConfigError(f"heldout.documents={documents}: {corpus} has only {len(lines)} documents, none would be "
                          f"left to train on")
    write_atomically(heldout, lines[:documents])
    write_atomically(rest, lines[documents:])


def run_step(step: str, seed: int, budget: AblationBudgetConfig, corpora: dict[str, str], output_dir: Path,
             overrides: Sequence[str], protocol: dict) -> StepResult:
    """Pretrains one step at one seed (or reads back the finished run) and returns its row; `protocol` is left
    empty unless the row's scores were computed under `protocol`."""
    definition = STEPS[step]
    seeded = [*overrides, f"trainer.seed={seed}", f"data.seed={seed}"]
    config = load_step_config(step, budget, corpora, seeded)
    parent = load_step_config(definition.parent, budget, corpora, seeded) if definition.parent else None
    run_dir = output_dir / step / f"seed{seed}"
    row_file = run_dir / ABLATION_RUN_ROW
    previous = json.loads(row_file.read_text()) if row_file.is_file() else {}
    trained = (run_dir / EXPORT_DIR / WEIGHTS_NAME).is_file()
    if trained and previous.get("protocol") == protocol:
        return StepResult(**previous)
    result = StepResult(step, definition.parent, definition.title, definition.carried_forward, budget.name, seed,
                        list(definition.changed_keys),
                        {k: list(v) for k, v in config_diff(parent, config).items()} if parent else {})
    if parent is not None and not result.effective_changes:
        result.notes.append(f"no effective change at the {budget.name!r} budget (e.g. both data sources are "
                            f"the same offline corpus): this step repeats its parent")
    if config.data.tokenizer not in BERT_BASE_UNCASED_ALIASES and not Path(config.data.tokenizer).is_dir() \
            and not hub_reachable():
        bpe = train_tokenizer(config.data, output_dir / ABLATION_TOKENIZERS_DIR / f"bpe-{budget.bpe_vocab_size}",
                              "bpe", budget.bpe_vocab_size, pad_to_multiple_of=1)  # the budget's size exactly
        result.notes.append(f"{config.data.tokenizer} is out of reach (hub unreachable): a byte-level BPE "
                            f"tokenizer ({budget.bpe_vocab_size} tokens) was trained with `tokenizers` on the "
                            f"step's corpus instead; its MLM losses are over other units, not comparable")
        config.data.tokenizer = str(bpe)
    paper_source = _paper_config(step).data.source
    if paper_source in budget.data_sources:
        result.notes.append(f"data: {paper_source} is replaced by the {budget.data_sources[paper_source]!r} corpus")
    result.tokenizer = "bert-base-uncased" if config.data.tokenizer in BERT_BASE_UNCASED_ALIASES else \
        Path(config.data.tokenizer).name
    result.data_source = config.data.source
    result.tokens_per_step = tokens_per_step(config)
    config.output_dir = str(run_dir)
    config.export_dir = str(run_dir / EXPORT_DIR)
    result.export_dir = config.export_dir
    started = time.perf_counter()
    if trained:  # rescored under another protocol: the training time is the earlier run's
        result.pretrain_seconds = previous.get("pretrain_seconds")
    else:
        config.resume = True
        run_pretraining(config)
        result.pretrain_seconds = round(time.perf_counter() - started, 1)
    result.parameters = _count_parameters(run_dir / EXPORT_DIR)
    csvs = metrics_csvs(config.output_dir)
    result.train_loss = final_value(csvs, "train/loss", last_n=5) if csvs else None
    return result


def evaluation_protocol(budget: AblationBudgetConfig, heldout: str | None, sts_dir: str | None) -> dict:
    """The settings a row's scores depend on: a finished run is re-scored when they change."""
    return {"heldout": dataclasses.asdict(budget.heldout) if heldout else None,
            "sts": dataclasses.asdict(budget.sts) if sts_dir else None,
            "glue": dataclasses.asdict(budget.glue) if budget.glue.tasks else None}


def evaluate_step(result: StepResult, budget: AblationBudgetConfig, heldout: str | None, sts_dir: str | None,
                  glue_path: str | None, run_dir: Path, protocol: dict) -> None:
    """Fills the row's scores: held-out MLM loss and pseudo-perplexity, the STS probe, the GLUE subset."""
    export = Path(result.export_dir)
    if heldout is not None:
        model, tokenizer = load_model_and_tokenizer(str(export))
        settings = budget.heldout
        scores = heldout_mlm_loss(model, tokenizer, heldout, settings.documents, settings.max_length,
                                  settings.mask_rate, settings.batch_size)
        result.heldout_loss, result.heldout_accuracy = scores["loss"], scores["accuracy"]
        if settings.pseudo_perplexity_documents:
            result.pseudo_perplexity = heldout_pseudo_perplexity(
                model, tokenizer, heldout, settings.pseudo_perplexity_documents,
                settings.pseudo_perplexity_max_length)["pseudo_perplexity"]
    if sts_dir is not None:
        result.sts_zero_shot, result.sts_tuned = sts_probe(export, budget.sts, sts_dir, run_dir / ABLATION_STS_DIR,
                                                           result.seed)
    if glue_path is not None:
        result.glue = evaluate_glue(export, budget.glue, glue_path, run_dir / ABLATION_GLUE_DIR)
        result.glue_score = sum(result.glue.values()) / len(result.glue)
    result.protocol = protocol


def sts_probe(export_dir: Path, sts: StsProbeConfig, data_dir: str, output_dir: Path,
              seed: int) -> tuple[float, Optional[float]]:
    """(zero-shot, tuned) STS Benchmark dev Spearman of the checkpoint's mean-pooled embeddings; tuned is None
    without fine-tuning steps. The fine-tune is the contrastive job (InfoNCE, in-batch negatives) on the train
    pairs scored >= 4, in fp32, from a fresh output directory."""
    config = ContrastiveConfig(model=str(export_dir), eval_sts=str(Path(data_dir) / STS_DEV), output_dir=str(output_dir))
    config.data.datasets = ["STSBenchmark"]
    config.data.local_files = {"STSBenchmark": str(Path(data_dir) / STS_TRAIN)}
    config.data.batch_size, config.data.max_length, config.data.seed = sts.batch_size, sts.max_length, seed
    config.optimizer.lr = sts.lr
    config.scheduler.warmup_steps = min(sts.warmup_steps, max(0, sts.finetune_steps - 1))
    config.trainer.max_steps = max(1, sts.finetune_steps)
    config.trainer.seed, config.trainer.precision, config.trainer.accelerator = seed, "32-true", "cpu"
    config.trainer.checkpoint_every_n_steps = 0
    config.logging.progress_bar = False
    if not sts.finetune_steps:
        backbone = load_backbone(config.model)
        return sts_scores(config, backbone, output_dir / STS_ZERO_SHOT_DIR)["full"], None
    shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted fine-tune starts again: it takes seconds
    summary = run_contrastive(config)
    shutil.rmtree(output_dir / EXPORT_DIR, ignore_errors=True)  # the scores are what the ladder keeps
    return summary["sts_zero_shot"], summary["sts_tuned"]


STS_TRAIN, STS_DEV = "sts-train.csv", "sts-dev.csv"


def _shared_data() -> Path:
    """$NEOBERT_SHARED_DATA (unset: ../shared/data from the working directory)."""
    shared = os.environ.get("NEOBERT_SHARED_DATA")
    return Path(shared) if shared else Path.cwd().parent / "shared" / "data"


def _sts_data_dir(sts: StsProbeConfig) -> tuple[str | None, str]:
    if sts.data_dir is None:
        return None, ""
    directory = _shared_data() / "stsbenchmark" if sts.data_dir == "auto" else Path(sts.data_dir)
    if (directory / STS_TRAIN).is_file() and (directory / STS_DEV).is_file():
        return str(directory), ""
    if sts.data_dir == "auto":
        return None, (f"STS probe: no STS Benchmark files in {directory} (set sts.data_dir to a folder with "
                      f"{STS_TRAIN} and {STS_DEV}): not scored")
    raise ConfigError(f"sts.data_dir={sts.data_dir!r}: needs {STS_TRAIN} and {STS_DEV} in it")


def shared_glue_dir() -> Path | None:
    """$NEOBERT_SHARED_DATA/glue (unset: ../shared/data/glue from the working directory) when it holds RTE."""
    root = _shared_data() / "glue"
    return root if (root / "rte").is_dir() else None


def _glue_data_path(glue: GlueSubsetConfig, output_dir: Path) -> tuple[str | None, str]:
    if glue.data_path != "auto":
        return glue.data_path, ""
    shared = shared_glue_dir()
    if shared is not None:
        steps = f"{glue.max_train_steps} steps" if glue.max_train_steps else "full"
        return str(shared), (f"GLUE: local files {shared} ({steps} fine-tuning on "
                             f"{glue.max_train_examples or 'all'} training examples)")
    corpus = write_demo_corpus(output_dir / ABLATION_CORPORA_DIR / "demo.jsonl")
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
FIGURE_METRICS = ("heldout_loss", "pseudo_perplexity", "sts_zero_shot", "sts_tuned", "glue_score")


def write_results(results: Sequence[StepResult], output_dir: str | Path) -> dict[str, Path]:
    """results.json (one row per run), results.md (mean +- sd per step, differences to the parent in standard
    errors, then every run) and one Figure 1 per measured metric (`figure1_<metric>.png`)."""
    output_dir = Path(output_dir)
    rows = [dataclasses.asdict(r) for r in results]
    paths = {"json": output_dir / RESULTS_JSON, "markdown": output_dir / ABLATION_RESULTS_MD}
    paths["json"].write_text(json.dumps(rows, indent=2, default=str) + "\n")
    paths["markdown"].write_text(results_markdown(rows) + "\n")
    summary = summarize_ladder(rows)
    for metric in measured_metrics(rows, FIGURE_METRICS):
        paths[metric] = plot_ablation_steps(summary, metric, output_dir / ablation_figure(metric))
    return paths


def read_results(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / RESULTS_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m experiments.ablations` first")
    return json.loads(path.read_text())


def measured_metrics(rows: Sequence[dict], metrics: Sequence[str] = tuple(LADDER_METRICS)) -> list[str]:
    """The metrics of `metrics` that at least one run has a value for."""
    return [m for m in metrics if any(r.get(m) is not None for r in rows)]


def results_markdown(rows: Sequence[dict]) -> str:
    """The per-step summary over seeds, then one line per run."""
    summary = summary_markdown(summarize_ladder(rows), metrics=measured_metrics(
        rows, ("heldout_loss", "pseudo_perplexity", "sts_zero_shot", "sts_tuned", "glue_score", "train_loss")))
    header = "| step | seed | params | tokens/step | " + " | ".join(
        LADDER_METRICS[m][0] for m in measured_metrics(rows)) + " | pretrain s | eval s |"
    lines = ["### Every run", "", header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        cells = [r["step"].upper(), str(r["seed"]), f"{r['parameters'] / 1e6:.2f}M" if r["parameters"] else "n/a",
                 str(r["tokens_per_step"] or "n/a")]
        cells += ["n/a" if r[m] is None else f"{r[m]:.4f}" for m in measured_metrics(rows)]
        cells += [str(r["pretrain_seconds"] or "-"), str(r["eval_seconds"] or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return summary + "\n\n" + "\n".join(lines)
