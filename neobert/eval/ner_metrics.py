"""Entity-level precision, recall and F1 of token classification (NER), with `seqeval` (CoNLL's conlleval rules:
an entity counts when its type and its exact span match), over whole sentences: words without a prediction
(cut by truncation, or without a sub-token) are predicted "O", so they count against recall, never vanish."""

from __future__ import annotations

from typing import Sequence

from seqeval.metrics import accuracy_score, classification_report, f1_score, precision_score, recall_score

OUTSIDE = "O"


def word_tags(num_words: int, word_positions: Sequence[int], token_predictions: Sequence[int],
              labels: Sequence[str]) -> list[str]:
    """One predicted tag per word: the prediction at its first sub-token (`word_positions[w]`, a position in
    `token_predictions`), "O" where the word has none (-1)."""
    return [labels[token_predictions[p]] if p >= 0 else OUTSIDE for p in word_positions[:num_words]]


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]],
                  per_type: bool = False) -> dict[str, float]:
    """Micro-averaged entity precision, recall and F1 (seqeval, default mode), and token accuracy; with
    `per_type`, also `f1_<type>` for every entity type in the gold tags. 0 where nothing is predicted."""
    if len(gold) != len(predicted) or any(len(g) != len(p) for g, p in zip(gold, predicted)):
        raise ValueError("gold and predicted tags must have the same sentences and lengths")
    gold, predicted = [list(g) for g in gold], [list(p) for p in predicted]
    scores = {
        "precision": float(precision_score(gold, predicted, zero_division=0)),
        "recall": float(recall_score(gold, predicted, zero_division=0)),
        "f1": float(f1_score(gold, predicted, zero_division=0)),
        "accuracy": float(accuracy_score(gold, predicted)),
    }
    if per_type:
        report = classification_report(gold, predicted, output_dict=True, zero_division=0)
        scores.update({f"f1_{name}": float(row["f1-score"]) for name, row in report.items()
                       if not name.endswith(" avg")})
    return scores
