"""Long-context retrieval scores (LongEmbed's synthetic tasks, `neobert.data.long_context`): each task is an mteb
retrieval task with one split per length (`test_256`, ...; the candidates of a query are the documents of its
length), scored by mteb like LongEmbed's own LEMBPasskeyRetrieval / LEMBNeedleRetrieval: main score nDCG@1, which
with one relevant document per query is the top-1 retrieval accuracy."""

from __future__ import annotations

from typing import Any, Sequence

from neobert.data.long_context import TASK_NAMES, LongContextExample, retrieval_splits
from neobert.eval.mteb import SplitsRetrievalTask, score_tasks

MAIN_SCORE = "ndcg_at_1"
REPORTED_SCORES = ("ndcg_at_1", "mrr_at_10", "ndcg_at_10", "recall_at_10")


def long_context_task(task: str, examples: Sequence[LongContextExample]) -> SplitsRetrievalTask:
    return SplitsRetrievalTask(TASK_NAMES[task], retrieval_splits(examples), main_score=MAIN_SCORE,
                               description=f"LongEmbed-style synthetic {task} retrieval, generated offline")


def score_long_context(encoder, examples_by_task: dict[str, Sequence[LongContextExample]],
                       batch_size: int = 8) -> dict[str, dict[int, dict[str, float]]]:
    """{task: {length: {score name: value}}} for any mteb encoder (ours, or a stand-in in tests)."""
    tasks = {name: long_context_task(name, examples) for name, examples in examples_by_task.items()}
    per_task = score_tasks(encoder, list(tasks.values()), batch_size=batch_size, show_progress_bar=False)
    scores: dict[str, dict[int, dict[str, float]]] = {}
    for name, task in tasks.items():
        per_split = per_task[task.metadata.name]["scores"]
        scores[name] = {int(split.removeprefix("test_")): {k: float(values[0][k]) for k in REPORTED_SCORES}
                        for split, values in sorted(per_split.items(), key=lambda kv: int(kv[0][5:]))}
    return scores


def markdown_table(results: dict[str, Any]) -> str:
    """One row per model and task, one column per length: nDCG@1 (top-1 accuracy) x 100; '-' past max_length."""
    lengths = sorted({int(n) for r in results.values() for t in r["scores"].values() for n in t})
    lines = [f"| model (max_length) | task | {' | '.join(str(n) for n in lengths)} |",
             "|---|---|" + "---|" * len(lengths)]
    for label, result in results.items():
        for task, per_length in result["scores"].items():
            cells = [f"{100 * per_length[n][MAIN_SCORE]:.1f}" if n in per_length else "-" for n in lengths]
            lines.append(f"| {label} ({result['max_length']}) | {task} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"
