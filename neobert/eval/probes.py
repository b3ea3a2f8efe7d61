"""Quick looks into pretrained checkpoints (export directories), used by the ablation notebook: fill-mask
predictions and sentence-embedding similarities (the similarity of paraphrases against that of unrelated
sentences). The `*_by_step` functions probe one run per ladder step (`ladder_probe_runs`) so steps can be compared;
the pseudo-perplexity of those runs against document length (paper Figure 2 over the ladder) is
`neobert.jobs.pseudo_perplexity.ladder_pseudo_perplexity`."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from neobert.data.backbone import Backbone, load_backbone
from neobert.eval.pseudo_perplexity import load_model_and_tokenizer
from neobert.model.heads import pool_embeddings
from neobert.model.modeling import NeoBERTForMaskedLM

# Hand-written paraphrase pairs: software documentation first (what the CPU ladder trains on), then general
# English. The mismatched pairs of `paraphrase_gap` pair each first sentence with the next pair's second one, so
# most of them stay within one domain: the gap then needs more than the topic to separate the two sides.
PARAPHRASE_PAIRS: tuple[tuple[str, str], ...] = (
    ("The function returns a list of all the keys in the dictionary.",
     "This method gives back every key of the dict as a list."),
    ("Install the package with pip before running the script.",
     "Before you run the script, use pip to install the package."),
    ("An exception is raised when the file cannot be opened.",
     "If the file can't be opened, an error is thrown."),
    ("The loop stops as soon as the condition becomes false.",
     "Iteration ends once the condition is no longer true."),
    ("Set the environment variable to change the default path.",
     "The default path can be changed through an environment variable."),
    ("The weather was cold and rainy all week.",
     "It rained and stayed cold for the whole week."),
    ("She bought fresh bread at the bakery this morning.",
     "This morning she picked up fresh bread from the bakery."),
    ("The meeting has been moved to Thursday afternoon.",
     "The meeting now takes place on Thursday afternoon."),
    ("He could not sleep because of the noise outside.",
     "The noise outside kept him awake all night."),
    ("The train to the city leaves every twenty minutes.",
     "Every twenty minutes a train departs for the city."),
)


def load_mlm(export_dir: str | Path) -> tuple[NeoBERTForMaskedLM, PreTrainedTokenizerBase]:
    """(NeoBERTForMaskedLM in eval mode, its tokenizer) from an export directory."""
    model, tokenizer = load_model_and_tokenizer(str(export_dir))
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------------------------- fill-mask
def fill_mask(export_dir: str | Path, text: str, top_k: int = 5) -> list[list[tuple[str, float]]]:
    """Top-k predictions with probabilities for every [MASK] in `text` ("[MASK]" is replaced by the checkpoint's
    own mask token, so the same sentence probes WordPiece and BPE checkpoints)."""
    model, tokenizer = load_mlm(export_dir)
    return _fill_mask(model, tokenizer, text, top_k)


def _fill_mask(model: NeoBERTForMaskedLM, tokenizer: PreTrainedTokenizerBase, text: str,
               top_k: int) -> list[list[tuple[str, float]]]:
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


def fill_mask_by_step(exports: Mapping[str, str | Path], texts: Sequence[str], top_k: int = 3) -> list[dict]:
    """One row per (step, text, [MASK] slot): {"step", "text", "slot", "predictions": "'tok' (p), 'tok' (p), ..."}
    (tokens quoted: BPE pieces can be blank), each checkpoint loaded once. `exports`: step -> export directory
    (`ladder_probe_runs`)."""
    rows = []
    for step, export_dir in exports.items():
        model, tokenizer = load_mlm(export_dir)
        for text in texts:
            for slot, predictions in enumerate(_fill_mask(model, tokenizer, text, top_k)):
                rows.append({"step": step, "text": text, "slot": slot,
                             "predictions": ", ".join(f"{token!r} ({p:.2g})" for token, p in predictions)})
    return rows


# ---------------------------------------------------------------------------------------------- embeddings
def _sentence_embeddings(backbone: Backbone, sentences: Sequence[str]) -> Tensor:
    """Unit-length mean-pooled embeddings [n, hidden] of the encoder's last hidden states."""
    batch = backbone.tokenizer(list(sentences), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = backbone(batch["input_ids"], batch["attention_mask"])
    return torch.nn.functional.normalize(pool_embeddings(hidden, batch["attention_mask"], "mean"), dim=-1)


def embedding_similarities(export_dir: str | Path, sentences: Sequence[str]):
    """Cosine similarities [n, n] (a NumPy array) between mean-pooled sentence embeddings of the checkpoint's
    encoder."""
    embeddings = _sentence_embeddings(load_backbone(str(export_dir)).eval(), sentences)
    return (embeddings @ embeddings.T).numpy()


def paraphrase_gap(export_dir: str | Path,
                   pairs: Sequence[tuple[str, str]] = PARAPHRASE_PAIRS) -> dict[str, float]:
    """Mean cosine similarity of the mean-pooled embeddings of paraphrase pairs ("paraphrase"), of mismatched pairs
    (first sentence i with second sentence (i + 1) mod n: "unrelated"), and their difference ("gap"). A collapsed
    encoder (every sentence mapped alike) has a gap near 0 however high its cosines are; a useful one a clear
    positive gap."""
    if len(pairs) < 2:
        raise ValueError(f"paraphrase_gap: needs at least two pairs to mismatch, got {len(pairs)}")
    embeddings = _sentence_embeddings(load_backbone(str(export_dir)).eval(),
                                      [first for first, _ in pairs] + [second for _, second in pairs])
    firsts, seconds = embeddings[:len(pairs)], embeddings[len(pairs):]
    paraphrase = float((firsts * seconds).sum(-1).mean())
    unrelated = float((firsts * seconds.roll(-1, dims=0)).sum(-1).mean())  # row i: seconds[(i + 1) % n]
    return {"paraphrase": paraphrase, "unrelated": unrelated, "gap": paraphrase - unrelated}


def paraphrase_gap_by_step(exports: Mapping[str, str | Path],
                           pairs: Sequence[tuple[str, str]] = PARAPHRASE_PAIRS) -> list[dict]:
    """One row per step: {"step", "paraphrase", "unrelated", "gap"} (`paraphrase_gap` of its export)."""
    return [{"step": step, **paraphrase_gap(export_dir, pairs)} for step, export_dir in exports.items()]


# ---------------------------------------------------------------------------------------------- the ladder
def ladder_probe_runs(rows: Sequence[Mapping], seed: int | None = None) -> dict[str, str]:
    """Step -> export directory of one run per step of a ladder's results.json rows, in the order the steps first
    appear: the run at `seed`, by default each step's smallest seed (the probes cost a model load per run, and one
    seed shows what changed between steps; the results table has the spread over seeds)."""
    runs_of: dict[str, dict[int, str]] = {}
    for row in rows:
        runs_of.setdefault(row["step"], {})[row["seed"]] = row["export_dir"]
    chosen = {}
    for step, runs in runs_of.items():
        if seed is not None and seed not in runs:
            raise ValueError(f"step {step!r} has no run at seed {seed}; its seeds are {sorted(runs)}")
        chosen[step] = runs[min(runs) if seed is None else seed]
    return chosen
