"""The held-out scores every checkpoint of the ablation ladder gets alike (docs/ablations.md): the MLM loss at a
fixed masking rate and the pseudo-perplexity, on the first documents of a local corpus.

Why not the training run's own `val/loss`: it masks at the step's training rate (M5 raises it to 20%) and with the
step's strategy, so the steps would be measured with different rulers. Here every model sees the same documents,
truncated alike, with the same positions masked (for models that share a tokenizer), all masked tokens [MASK].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from neobert.config.pretrain import MaskingConfig, PretrainDataConfig
from neobert.data.corpus import iterate_documents, truncate
from neobert.data.pretraining import validation_batches
from neobert.eval.pseudo_perplexity import score_documents
from neobert.model.heads import IGNORE_INDEX
from neobert.model.modeling import NeoBERTForMaskedLM


def heldout_data(source: str, documents: int, max_length: int) -> PretrainDataConfig:
    """The data config that reads the first `documents` documents of a local .jsonl/.parquet/.txt corpus with a
    `content` column, one per row (no packing), truncated to `max_length` tokens."""
    return PretrainDataConfig(source=source, hub_config=None, text_column="content", max_length=max_length,
                              packing="none", num_workers=0, validation_docs=documents)


@torch.no_grad()
def heldout_mlm_loss(model: NeoBERTForMaskedLM, tokenizer, source: str, documents: int, max_length: int = 128,
                     mask_rate: float = 0.15, batch_size: int = 32, seed: int = 0) -> dict:
    """{"loss", "accuracy", "masked_tokens", "documents"}: the mean cross-entropy (and top-1 accuracy) over every
    masked token of the first `documents` documents of `source`, masked once with a fixed seed."""
    data = heldout_data(source, documents, max_length)
    data.seed = seed
    masking = MaskingConfig(rate=mask_rate, strategy="all_mask")
    model.eval()
    nll_sum, correct, masked, rows = 0.0, 0, 0, 0
    for batch in validation_batches(data, masking, tokenizer, batch_size):
        labels = batch["labels"]
        logits = model(batch["input_ids"], batch["attention_mask"], labels=labels, masked_only=True).logits
        targets = labels[labels != IGNORE_INDEX]
        nll_sum += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        correct += int((logits.argmax(-1) == targets).sum())
        masked += targets.numel()
        rows += labels.shape[0]
    if masked == 0:
        raise ValueError(f"held-out evaluation: no token was masked in the first {documents} documents of {source}")
    return {"loss": nll_sum / masked, "accuracy": correct / masked, "masked_tokens": masked, "documents": rows}


@torch.no_grad()
def heldout_pseudo_perplexity(model: NeoBERTForMaskedLM, tokenizer, source: str, documents: int,
                              max_length: int = 64) -> dict:
    """{"pseudo_perplexity", "scored_tokens", "documents"}: every token of the first `documents` documents of
    `source` (truncated to `max_length` tokens) masked once; the perplexity pools all tokens (exp of the mean
    negative log-likelihood), so long documents count by their length."""
    special = set(tokenizer.all_special_ids)
    ids = [truncate(document, max_length, special)
           for document in iterate_documents(heldout_data(source, 0, max_length), tokenizer, max_docs=documents)]
    scores = score_documents(model, ids, special, tokenizer.mask_token_id, "heldout")
    tokens = sum(s.scored_tokens for s in scores)
    if tokens == 0:
        raise ValueError(f"pseudo-perplexity: no token to score in the first {documents} documents of {source}")
    return {"pseudo_perplexity": math.exp(sum(s.nll_sum for s in scores) / tokens), "scored_tokens": tokens,
            "documents": len(scores)}
