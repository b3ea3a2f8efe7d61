"""Pseudo-perplexity (Salazar et al., 2020) of a masked language model, per document, bucketed by length
(paper Figure 2).

Every scorable token of a document is masked exactly once: one masked copy of the document per token, many
copies per forward pass (`tokens_per_forward`), and the decoder is applied at the masked position only.
The pseudo-log-likelihood of a document is the sum over its tokens of log p(token | the rest); special
tokens ([CLS], [SEP]) are never masked nor scored. PPPL = exp(-PLL / scored tokens), per document and per
length bucket (token-weighted: exp of the mean NLL of all tokens of the bucket's documents). The run over the
models of a config, its reports and files is `neobert.jobs.pseudo_perplexity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from neobert.data.tokenizer import BERT_BASE_UNCASED, load_tokenizer
from neobert.eval.flops import warn_if_bf16_is_emulated
from neobert.layout import CONFIG_NAME, WEIGHTS_NAME, has_tokenizer
from neobert.model.heads import IGNORE_INDEX
from neobert.model.modeling import NeoBERTForMaskedLM


# ---------------------------------------------------------------------------------------------- scoring
def masked_copies(input_ids: Tensor, positions: Tensor, mask_token_id: int) -> tuple[Tensor, Tensor]:
    """One copy of `input_ids` [L] per position, with that position (only) replaced by [MASK].
    Returns (ids [n, L], labels [n, L]: the original token at the masked position, -100 elsewhere)."""
    rows = torch.arange(positions.numel(), device=input_ids.device)
    ids = input_ids.repeat(positions.numel(), 1)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[rows, positions] = ids[rows, positions]
    ids[rows, positions] = mask_token_id
    return ids, labels


@torch.inference_mode()
def token_nlls(model: NeoBERTForMaskedLM, input_ids: Tensor, scored: Tensor, mask_token_id: int,
               tokens_per_forward: int = 16384) -> Tensor:
    """-log p(token_i | document without token_i) for every scored position i, in position order.

    input_ids: [L] one document; scored: bool [L], False for special tokens."""
    if input_ids.dim() != 1 or scored.shape != input_ids.shape:
        raise ValueError(f"expected one document [L] and a scored mask of the same shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(scored.shape)}")
    positions = scored.nonzero().squeeze(1)
    copies_per_forward = max(1, tokens_per_forward // input_ids.numel())
    nlls = []
    for chunk in positions.split(copies_per_forward):
        ids, labels = masked_copies(input_ids, chunk, mask_token_id)
        # masked_only: the decoder runs at the one masked position of each copy; rows come back in copy order.
        logits = model(ids, labels=labels, masked_only=True).logits
        nlls.append(F.cross_entropy(logits.float(), labels[labels != IGNORE_INDEX], reduction="none"))
    return torch.cat(nlls) if nlls else input_ids.new_zeros(0, dtype=torch.float32)


@dataclass
class DocumentScore:
    model: str
    document: int
    num_tokens: int  # special tokens included (the bucketing length)
    scored_tokens: int
    nll_sum: float
    pppl: float


def score_documents(model: NeoBERTForMaskedLM, documents: Iterable[list[int]], special_ids: set[int],
                    mask_token_id: int, model_name: str, tokens_per_forward: int = 16384,
                    progress: Callable | None = None, dtype: torch.dtype | None = None) -> list[DocumentScore]:
    """Per-document pseudo-perplexity; the model runs under autocast to `dtype` when one is given."""
    device = next(model.parameters()).device
    warn_if_bf16_is_emulated(device.type, dtype)
    model.eval()
    scores = []
    documents = list(documents)
    iterator = progress(documents) if progress else documents
    for index, ids in enumerate(iterator):
        input_ids = torch.tensor(ids, device=device)
        scored = torch.tensor([t not in special_ids for t in ids], device=device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype not in (None, torch.float32)):
            nll = token_nlls(model, input_ids, scored, mask_token_id, tokens_per_forward)
        if nll.numel() == 0:
            continue
        total = float(nll.sum())
        scores.append(DocumentScore(model_name, index, len(ids), nll.numel(), total, math.exp(total / nll.numel())))
    return scores


# ---------------------------------------------------------------------------------------------- buckets
def bucket_of(num_tokens: int, edges: list[int]) -> int | None:
    """Index of the first edge >= num_tokens (None when longer than the last edge)."""
    return next((i for i, edge in enumerate(edges) if num_tokens <= edge), None)


def select_documents(token_lists: Iterable[list[int]], edges: list[int], docs_per_bucket: int, min_tokens: int,
                     max_scanned: int) -> list[list[int]]:
    """Fills every length bucket with up to `docs_per_bucket` documents, in source order."""
    counts = [0] * len(edges)
    chosen = []
    for scanned, ids in enumerate(token_lists, 1):
        bucket = bucket_of(len(ids), edges)
        if len(ids) >= min_tokens and bucket is not None and counts[bucket] < docs_per_bucket:
            counts[bucket] += 1
            chosen.append(ids)
        if all(c >= docs_per_bucket for c in counts) or scanned >= max_scanned:
            break
    return chosen


@dataclass
class BucketScore:
    model: str
    bucket_low: int  # exclusive
    bucket_high: int  # inclusive
    documents: int
    scored_tokens: int
    pppl: float  # token-weighted: exp(sum NLL / sum scored tokens)
    median_document_pppl: float


def bucket_scores(scores: list[DocumentScore], edges: list[int]) -> list[BucketScore]:
    out = []
    for model in dict.fromkeys(s.model for s in scores):
        for i, high in enumerate(edges):
            low = edges[i - 1] if i else 0
            group = [s for s in scores if s.model == model and low < s.num_tokens <= high]
            if not group:
                continue
            tokens = sum(s.scored_tokens for s in group)
            pppls = sorted(s.pppl for s in group)
            median = pppls[len(pppls) // 2] if len(pppls) % 2 else 0.5 * (pppls[len(pppls) // 2 - 1] +
                                                                           pppls[len(pppls) // 2])
            out.append(BucketScore(model, low, high, len(group), tokens,
                                   math.exp(sum(s.nll_sum for s in group) / tokens), median))
    return out


# ---------------------------------------------------------------------------------------------- loading
def load_model_and_tokenizer(directory: str, tokenizer: str | None = None):
    """(NeoBERTForMaskedLM, its tokenizer) from an export directory; `tokenizer` overrides the one beside it."""
    path = Path(directory)
    if not (path / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"models: {directory!r} is not a NeoBERT export directory (no {CONFIG_NAME})")
    model = NeoBERTForMaskedLM.from_pretrained(path)
    if "decoder.weight" not in _weight_names(path):
        raise ValueError(f"models: {directory!r} has no MLM head (decoder.*): pseudo-perplexity needs one")
    tok = load_tokenizer(tokenizer or (str(path) if has_tokenizer(path) else BERT_BASE_UNCASED),
                         max_length=model.config.max_length)
    if tok.mask_token_id is None:
        raise ValueError(f"the tokenizer of {directory!r} has no mask token")
    return model, tok


def _weight_names(path: Path) -> set[str]:
    with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
        return set(f.keys())
