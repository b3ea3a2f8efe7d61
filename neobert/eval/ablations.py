"""The ablation ladder M0..M10 (NEOBERT_SPEC section 3, paper Table 2 and Figure 1): its definition, the
budgets that rescale it, and the runner that pretrains and evaluates every step.

Each step is one change on top of its parent, the previous *kept* step: the tokenizer (M3) and packing (M6)
steps branch off and are reverted, so M4 starts from M2 and M7 from M5. `configs/ablations/mXX.yaml` holds
each step at the paper's scale, `inherit:`ing its parent and stating only its change; `LADDER` lists the
config keys each step changes, and `config_diff` (tested) proves that nothing else differs.

A budget (`configs/ablations/budgets/{tiny,small,paper}.yaml`) maps the paper's shapes, lengths and batch
sizes to smaller ones. It is a function of the config, applied alike to a step and to its parent, so a
step's diff at any budget is a subset of its documented keys (it can become empty, e.g. M2's data change
when both corpora are the offline demo corpus; the results say so).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from neobert.config import ConfigError, load_config
from neobert.lit.pretrain_config import PretrainConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs" / "ablations"
BUDGET_DIR = CONFIG_DIR / "budgets"
BERT_TOKENIZERS = ("google-bert/bert-base-uncased", "bert-base-uncased")
MISSING = "<absent>"


# ---------------------------------------------------------------------------------------------- the ladder
@dataclass(frozen=True)
class AblationStep:
    step: str
    parent: Optional[str]  # the kept step it changes
    title: str
    changed_keys: tuple[str, ...]  # PretrainConfig leaves that differ from the parent, at the paper's scale
    carried_forward: bool  # False: reverted, the next step starts from this step's parent
    paper_glue_delta: str = ""  # the paper's reported effect, where NEOBERT_SPEC gives it


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
                raise ValueError(f"--steps: unknown step in {part!r}; steps are {names}")
            chosen += names[names.index(start): names.index(end) + 1]
        elif part in STEPS:
            chosen.append(part)
        else:
            raise ValueError(f"--steps: unknown step {part!r}; steps are {names}")
    return list(dict.fromkeys(chosen))


def step_config_path(step: str) -> Path:
    if step not in STEPS:
        raise ValueError(f"unknown ablation step {step!r}; steps are {list(STEPS)}")
    return CONFIG_DIR / f"{step}.yaml"


# ---------------------------------------------------------------------------------------------- budgets
@dataclass
class ModelShape:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int


@dataclass
class GlueSubset:
    """How each checkpoint is evaluated: a short fine-tune per task (neobert.lit.glue.run_task)."""

    tasks: List[str] = field(default_factory=lambda: ["rte"])
    # Local GLUE files (hub parquet or GLUE TSV layout); "auto": ../shared/data/glue when present, else the
    # built-in fallback task; None: the hub's nyu-mll/glue.
    data_path: Optional[str] = "auto"
    max_train_steps: int = 0  # 0 = the full fine-tuning (10 epochs)
    batch_size: int = 16
    lr: float = 2e-5
    max_length: int = 128
    max_train_examples: int = 0
    max_eval_examples: int = 0
    seed: int = 0


@dataclass
class AblationBudget:
    name: str = "paper"
    max_steps: Optional[int] = None  # None keeps the step's value
    warmup_steps: Optional[int] = None  # caps every step's warm-up
    # Multiplies every step's peak lr: tiny models trained for a few dozen steps need a larger one. Applied to
    # the step and its parent alike, so the steps' relative lr (M4 changes it) is kept.
    lr_scale: float = 1.0
    devices: Optional[int] = None
    micro_batch_size: Optional[int] = None  # most sequences per micro batch; accumulation makes up the rest
    shapes: Dict[str, ModelShape] = field(default_factory=dict)  # "12x768" -> the budget's shape
    lengths: Dict[str, int] = field(default_factory=dict)  # paper max length -> budget max length
    tokens_per_step: Dict[str, int] = field(default_factory=dict)  # paper tokens/step -> budget tokens/step
    data_source: Optional[str] = None  # "demo": the offline demo corpus for every step; None keeps each step's
    bpe_vocab_size: int = 32000  # the trained stand-in of the LLaMA tokenizer when the hub is out of reach
    pretrain_overrides: Dict[str, Any] = field(default_factory=dict)  # dotted PretrainConfig keys for every step
    glue: GlueSubset = field(default_factory=GlueSubset)


def load_budget(name_or_path: str, overrides: Sequence[str] = ()) -> AblationBudget:
    path = Path(name_or_path)
    if not path.is_file():
        path = BUDGET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in BUDGET_DIR.glob("*.yaml"))
        raise ConfigError(f"--budget {name_or_path!r}: no such budget file; known budgets: {known}")
    return load_config(AblationBudget, path, overrides)


def tokens_per_step(config: PretrainConfig) -> int:
    trainer = config.trainer
    devices = int(trainer.devices) if str(trainer.devices).isdigit() else 1
    return trainer.micro_batch_size * trainer.accumulate_grad_batches * devices * trainer.num_nodes * \
        config.data.max_length


def apply_budget(config: PretrainConfig, budget: AblationBudget, corpus: str | None = None) -> PretrainConfig:
    """The step's config at the budget's scale. A pure function of the config: equal inputs map alike."""
    from neobert.model.config import NeoBERTConfig

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
        dotlist = [f"{key}={_yaml_value(value)}" for key, value in budget.pretrain_overrides.items()]
        merged = OmegaConf.merge(OmegaConf.structured(config), OmegaConf.from_dotlist(dotlist))
        config = OmegaConf.to_object(merged)
    return config


def _yaml_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else ("null" if value is None else str(value))


@functools.lru_cache(maxsize=None)
def _paper_config(step: str) -> PretrainConfig:
    return load_config(PretrainConfig, step_config_path(step))


def load_step_config(step: str, budget: AblationBudget | None = None, corpus: str | None = None,
                     overrides: Sequence[str] = ()) -> PretrainConfig:
    """The step's PretrainConfig (a fresh copy), at the budget's scale when one is given."""
    config = copy.deepcopy(_paper_config(step))
    if budget is not None:
        config = apply_budget(config, budget, corpus)
    if overrides:
        merged = OmegaConf.merge(OmegaConf.structured(config), OmegaConf.from_dotlist(list(overrides)))
        config = OmegaConf.to_object(merged)
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


# ---------------------------------------------------------------------------------------------- offline stand-ins
def train_bpe_tokenizer(data, vocab_size: int, directory: str | Path, max_docs: int = 100_000) -> Path:
    """A byte-level BPE tokenizer trained with `tokenizers` on the step's own corpus, saved as a Hugging Face
    tokenizer directory: the offline stand-in of the LLaMA tokenizer (a SentencePiece BPE of 32,000 tokens).
    Specials: <pad> (id 0) <s> </s> <unk> <mask>; documents are encoded as <s> ... </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from neobert.data.pretraining import open_source, text_column

    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return directory
    column = text_column(data)
    texts = (row[column] for row, _ in zip(open_source(data), range(max_docs)) if row.get(column))
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", mask_token="<mask>", cls_token="<s>", sep_token="</s>")
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(str(tmp))
    os.replace(tmp, directory)
    return directory


def shared_glue_dir() -> Path | None:
    """../shared/data/glue beside the repository (or $NEOBERT_SHARED_DATA/glue) when it holds RTE."""
    root = Path(os.environ.get("NEOBERT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")) / "glue"
    return root if (root / "rte").is_dir() else None


def write_fallback_glue(corpus: str | Path, directory: str | Path, train: int = 480, validation: int = 160,
                        seed: int = 0) -> Path:
    """A small pair-classification task in GLUE RTE's parquet layout, built from the demo corpus, for machines
    with neither the hub nor GLUE files: sentence1 is a passage of a document, sentence2 is either another
    passage of the same document (label 0, "entailment") or of a document on another topic (label 1). It is
    not RTE; it only tells whether pretraining taught the encoder something about topical coherence."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory) / "rte"
    if (directory / "validation.parquet").is_file():
        return directory.parent
    documents = [json.loads(line) for line in Path(corpus).read_text(encoding="utf-8").splitlines() if line]
    by_topic: dict[str, list[str]] = {}
    for doc in documents:
        sentences = [s.strip() for s in doc["content"].replace("\n", " ").split(". ") if len(s.split()) >= 4]
        by_topic.setdefault(doc["topic"], []).extend(sentences)
    topics = [t for t, s in by_topic.items() if len(s) >= 2]
    if len(topics) < 2:
        raise RuntimeError(f"{corpus}: too few topics to build the fallback pair task")
    rng = random.Random(seed)
    rows = []
    for index in range(train + validation):
        topic = rng.choice(topics)
        first, second = rng.sample(by_topic[topic], 2)
        label = index % 2  # balanced classes
        if label:
            other = rng.choice([t for t in topics if t != topic])
            second = rng.choice(by_topic[other])
        rows.append({"sentence1": first, "sentence2": second, "label": label})
    rng.shuffle(rows)
    directory.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:train]), ("validation", rows[train:])):
        table = pa.Table.from_pylist([{**r, "idx": i} for i, r in enumerate(part)])
        pq.write_table(table, directory / f"{split}.parquet")
    return directory.parent


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


def run_ladder(steps: Sequence[str], budget: AblationBudget, output_dir: str | Path, evaluate: bool = True,
               overrides: Sequence[str] = ()) -> list[StepResult]:
    """Pretrains every step (through `neobert.lit.pretrain.run_pretraining`), fine-tunes each checkpoint on the
    budget's GLUE subset (through `neobert.lit.glue.run_task`) and writes results.json / results.md /
    glue_per_step.png under `output_dir`. A step whose export already exists is not retrained."""
    from neobert.hub import hub_reachable

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpus = None
    if budget.data_source == "demo":
        from neobert.data.demo_corpus import write_demo_corpus

        corpus = str(write_demo_corpus(output_dir / "corpus.jsonl"))
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
        if config.data.tokenizer not in BERT_TOKENIZERS and not Path(config.data.tokenizer).is_dir() \
                and not hub_reachable():
            bpe = train_bpe_tokenizer(config.data, budget.bpe_vocab_size,
                                      output_dir / "tokenizers" / f"bpe-{budget.bpe_vocab_size}")
            result.notes.append(f"{config.data.tokenizer} is out of reach (hub unreachable): a byte-level BPE "
                                f"tokenizer ({budget.bpe_vocab_size} tokens) was trained with `tokenizers` on the "
                                f"same corpus instead ({bpe}); its MLM loss is over other units, not comparable")
            config.data.tokenizer = str(bpe)
        if corpus is not None:
            result.notes.append(f"data: the offline demo corpus ({corpus}), not {_paper_source(step)}")
        config.run_dir = str(output_dir / step)
        config.export_dir = str(output_dir / step / "export")
        result.export_dir = config.export_dir
        export = Path(config.export_dir)
        started = time.perf_counter()
        if not (export / "model.safetensors").is_file():
            from neobert.lit.pretrain import run_pretraining

            config.resume = True
            run_pretraining(config)
            result.pretrain_seconds = round(time.perf_counter() - started, 1)
        result.parameters = _count_parameters(export)
        result.train_loss = _final_train_loss(Path(config.run_dir))
        if evaluate:
            started = time.perf_counter()
            result.glue = evaluate_glue(export, budget.glue, glue_path, output_dir / step / "glue")
            result.glue_score = sum(result.glue.values()) / len(result.glue) if result.glue else None
            result.glue_seconds = round(time.perf_counter() - started, 1)
            if glue_note:
                result.notes.append(glue_note)
        results.append(result)
        write_results(results, output_dir)  # after every step: a long ladder can be read while it runs
    return results


def _paper_source(step: str) -> str:
    return _paper_config(step).data.source


def _glue_data_path(glue: GlueSubset, output_dir: Path, corpus: str | None) -> tuple[str | None, str]:
    if glue.data_path != "auto":
        return glue.data_path, ""
    shared = shared_glue_dir()
    if shared is not None:
        steps = f"{glue.max_train_steps} steps" if glue.max_train_steps else "full"
        return str(shared), (f"GLUE: local files {shared} ({steps} fine-tuning on "
                             f"{glue.max_train_examples or 'all'} training examples)")
    if corpus is None:
        from neobert.data.demo_corpus import write_demo_corpus

        corpus = str(write_demo_corpus(output_dir / "corpus.jsonl"))
    fallback = write_fallback_glue(corpus, output_dir / "glue_fallback")
    return str(fallback), (f"GLUE: no GLUE files here; scored on the built-in fallback pair task built from the "
                           f"demo corpus ({fallback}/rte), not on RTE")


def evaluate_glue(export_dir: str | Path, glue: GlueSubset, data_path: str | None, output_dir: Path) -> dict:
    """Main score (a fraction) per task of the subset, from a short fine-tune of the checkpoint."""
    from neobert.lit.glue import GlueConfig, run_task

    scores = {}
    for task in glue.tasks:
        config = GlueConfig(task=task, model=str(export_dir), output_dir=str(output_dir))
        config.data.path = data_path
        config.data.batch_size = glue.batch_size
        config.data.max_length = glue.max_length
        config.data.max_train_examples = glue.max_train_examples
        config.data.max_eval_examples = glue.max_eval_examples
        config.optim.lr = glue.lr
        config.trainer.seed = glue.seed
        config.trainer.enable_progress_bar = False
        if glue.max_train_steps:
            config.trainer.max_steps = glue.max_train_steps
            config.trainer.eval_every_n_steps = max(1, glue.max_train_steps // 3)
        summary = run_task(config)
        scores[task] = float(summary["scores"]["score"])
    return scores


def _count_parameters(export: Path) -> int | None:
    from safetensors import safe_open

    path = export / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _final_train_loss(run_dir: Path) -> float | None:
    from neobert.lit.plotting import final_value

    csvs = sorted((run_dir / "logs").glob("version_*/metrics.csv"))
    return final_value(csvs, "train/loss") if csvs else None


# ---------------------------------------------------------------------------------------------- results
def write_results(results: Sequence[StepResult], output_dir: str | Path) -> dict[str, Path]:
    from neobert.eval.plots import plot_ablation_glue

    output_dir = Path(output_dir)
    rows = [dataclasses.asdict(r) for r in results]
    paths = {"json": output_dir / "results.json", "markdown": output_dir / "results.md"}
    paths["json"].write_text(json.dumps(rows, indent=2, default=str) + "\n")
    paths["markdown"].write_text(results_markdown(rows) + "\n")
    if any(r["glue_score"] is not None for r in rows):
        paths["plot"] = plot_ablation_glue(rows, output_dir / "glue_per_step.png")
    return paths


def read_results(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "results.json"
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


# ---------------------------------------------------------------------------------------------- exploring checkpoints
def load_mlm(export_dir: str | Path):
    """(NeoBERTForMaskedLM in eval mode, its tokenizer) from an export directory."""
    from neobert.eval.pseudo_perplexity import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(export_dir))
    return model.eval(), tokenizer


def fill_mask(export_dir: str | Path, text: str, top_k: int = 5) -> list[list[tuple[str, float]]]:
    """Top-k predictions with probabilities for every [MASK] in `text` ("[MASK]" is replaced by the checkpoint's
    own mask token, so the same sentence probes WordPiece and BPE checkpoints)."""
    import torch

    model, tokenizer = load_mlm(export_dir)
    text = text.replace("[MASK]", tokenizer.mask_token)
    encoded = tokenizer(text, return_tensors="pt", truncation=True)
    positions = (encoded["input_ids"][0] == tokenizer.mask_token_id).nonzero().flatten()
    if positions.numel() == 0:
        raise ValueError(f"fill_mask: no [MASK] in {text!r}")
    with torch.no_grad():
        logits = model(encoded["input_ids"], encoded["attention_mask"]).logits[0, positions]
    probs = logits.float().softmax(-1)
    top = probs.topk(top_k, dim=-1)
    return [[(tokenizer.decode([int(i)]).strip(), float(p)) for p, i in zip(values, indices)]
            for values, indices in zip(top.values, top.indices)]


def embedding_similarities(export_dir: str | Path, sentences: Sequence[str]):
    """Cosine similarities [n, n] between mean-pooled sentence embeddings of the checkpoint's encoder."""
    import torch

    from neobert.model.backbone import load_backbone
    from neobert.model.modeling import pool_embeddings

    backbone = load_backbone(str(export_dir)).eval()
    batch = backbone.tokenizer(list(sentences), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = backbone(batch["input_ids"], batch["attention_mask"])
    embeddings = torch.nn.functional.normalize(pool_embeddings(hidden, batch["attention_mask"], "mean"), dim=-1)
    return (embeddings @ embeddings.T).numpy()


def ladder_pseudo_perplexity(results: Sequence[dict], corpus: str | Path, bucket_edges: Sequence[int],
                             docs_per_bucket: int = 2, steps: Sequence[str] | None = None):
    """Per-bucket pseudo-perplexity of the ladder's checkpoints on `corpus` (Figure 2 over the ladder). Only
    comparable between checkpoints that share a tokenizer."""
    from neobert.eval.pseudo_perplexity import PseudoPerplexityConfig, run_pseudo_perplexity

    chosen = [r for r in results if steps is None or r["step"] in steps]
    config = PseudoPerplexityConfig(models=[r["export_dir"] for r in chosen], bucket_edges=list(bucket_edges),
                                    docs_per_bucket=docs_per_bucket, device="cpu")
    config.data.source = str(corpus)
    config.data.hub_config = None
    config.data.text_column = "content"
    _, buckets = run_pseudo_perplexity(config)
    return buckets
