"""The ablation ladder's job (`python -m experiments.ablations`; docs/ablations.md): pretrain every step of
`neobert.jobs.ablation_ladder` at a budget and seed, evaluate it (`neobert.jobs.ablation_eval`), and write the
results table, summary and figures.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence


from neobert.config import ConfigError
from neobert.config.ablations import AblationBudgetConfig
from neobert.data.demo_corpus import write_demo_corpus
from neobert.data.offline_corpus import write_offline_corpus
from neobert.data.tokenizer import BERT_BASE_UNCASED_ALIASES, train_tokenizer
from neobert.eval.ladder_stats import LADDER_METRICS, summarize_ladder, summary_markdown
from neobert.eval.plots import final_value, plot_ablation_steps
from neobert.hub import hub_reachable
from neobert.jobs.ablation_eval import (count_parameters, evaluate_step, evaluation_protocol, glue_data_path,
                                        sts_data_dir)
from neobert.jobs.ablation_ladder import (STEPS, StepResult, config_diff, load_budget, load_step_config,
                                          paper_config, parse_steps, tokens_per_step)
from neobert.jobs.pretrain import run_pretraining
from neobert.layout import (ABLATION_CORPORA_DIR, ABLATION_HELDOUT, ABLATION_RESULTS_MD, ABLATION_RUN_ROW,
                            ABLATION_TOKENIZERS_DIR, EXPORT_DIR, RESULTS_JSON, WEIGHTS_NAME, ablation_figure,
                            has_tokenizer, metrics_csvs, write_atomically)


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
    glue_path, glue_note = glue_data_path(budget.glue, output_dir) if evaluate and budget.glue.tasks else (None, "")
    sts_dir, sts_note = sts_data_dir(budget.sts) if evaluate else (None, "")
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
        bpe = output_dir / ABLATION_TOKENIZERS_DIR / f"bpe-{budget.bpe_vocab_size}"
        if not has_tokenizer(bpe):  # trained once, then shared by every step and seed
            train_tokenizer(config.data, bpe, "bpe", budget.bpe_vocab_size, pad_to_multiple_of=1,  # the budget's size
                            keys=("bpe_vocab_size", "max_docs"))
        result.notes.append(f"{config.data.tokenizer} is out of reach (hub unreachable): a byte-level BPE "
                            f"tokenizer ({budget.bpe_vocab_size} tokens) was trained with `tokenizers` on the "
                            f"step's corpus instead; its MLM losses are over other units, not comparable")
        config.data.tokenizer = str(bpe)
    paper_source = paper_config(step).data.source
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
    result.parameters = count_parameters(run_dir / EXPORT_DIR)
    csvs = metrics_csvs(config.output_dir)
    result.train_loss = final_value(csvs, "train/loss", last_n=5) if csvs else None
    return result


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
