"""Hard-negative mining without a model: from L2-normalised embeddings of queries, their positives and a corpus,
pick for every query the best-ranked corpus texts that are neither the query nor one of its positives and that
score clearly below its positive. A candidate scoring about as high as the positive is more likely an unlabelled
positive than a negative (a "false negative", which would teach the model to push a right answer away), so
`margin` (absolute) and `max_score_ratio` (relative) drop it.

Scores are cosine similarities (dot products of unit vectors). `search="exact"` is a chunked matmul + topk in
torch; `search="faiss"` is the same search with faiss' `IndexFlatIP` (an optional dependency: pip install
faiss-cpu), faster on large corpora.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from neobert.errors import ConfigError

try:  # optional dependency, only for search="faiss"; its absence is reported when that search is asked for
    import faiss
except ImportError:
    faiss = None

SEARCHES = ("exact", "faiss")
SCORE_BUDGET = 2**26  # query x corpus scores the search holds at once (256 MiB of float32)
MAX_QUERY_CHUNK = 1024


@dataclass
class MiningResult:
    negatives: list[list[str]]  # per query, best-ranked first
    negative_scores: list[list[float]]
    positive_scores: list[float]
    dropped_as_positive: int  # retrieved candidates that were the query itself or one of its positives
    dropped_by_margin: int  # retrieved candidates above the margin / ratio threshold: likely false negatives
    short_queries: int  # queries left with fewer than num_negatives negatives (kept with what they have)


def mine_hard_negatives(query_embeddings: Tensor, positive_embeddings: Tensor, corpus_embeddings: Tensor,
                        corpus_texts: Sequence[str], queries: Sequence[str], positives: Sequence[str], *,
                        num_negatives: int = 5, top_k: int = 50, skip_top: int = 0, margin: float = 0.0,
                        max_score_ratio: Optional[float] = None, search: str = "exact") -> MiningResult:
    """Embeddings are unit vectors, float32 [N, d] (queries and positives, row i = example i) and [C, d] (corpus).

    Per query the `top_k` best corpus candidates are retrieved; then dropped, in this order: the query's own text
    and every positive the examples pair with that query text (exact match after strip), the first `skip_top` of
    the remaining ranks, and those scoring above `positive_score - margin` or, when set, above
    `max_score_ratio * positive_score`. The first `num_negatives` survivors, in rank order, are the negatives."""
    _check_inputs(query_embeddings, positive_embeddings, corpus_embeddings, corpus_texts, queries, positives,
                  num_negatives, top_k, search)
    query_embeddings, corpus_embeddings = query_embeddings.float().cpu(), corpus_embeddings.float().cpu()
    positive_scores = (query_embeddings * positive_embeddings.float().cpu()).sum(dim=1)
    thresholds = positive_scores - margin
    if max_score_ratio is not None:
        thresholds = torch.minimum(thresholds, max_score_ratio * positive_scores)
    excluded = _excluded_corpus_ids(corpus_texts, queries, positives)
    negatives, negative_scores = [], []
    dropped_as_positive = dropped_by_margin = 0
    for start, scores, ids in _search(query_embeddings, corpus_embeddings, min(top_k, len(corpus_texts)), search):
        rows = range(start, start + len(ids))
        is_positive = _is_excluded(ids, [excluded[row] for row in rows], len(corpus_texts))
        rank = (~is_positive).cumsum(dim=1) - 1  # rank among the candidates that are not the query's own texts
        eligible = ~is_positive & (rank >= skip_top)
        above = scores > thresholds[start:start + len(ids), None]
        kept = eligible & ~above
        kept &= kept.cumsum(dim=1) <= num_negatives
        dropped_as_positive += int(is_positive.sum())
        dropped_by_margin += int((eligible & above).sum())
        for row_ids, row_scores, row_kept in zip(ids, scores, kept):
            negatives.append([corpus_texts[i] for i in row_ids[row_kept].tolist()])
            negative_scores.append(row_scores[row_kept].tolist())
    short_queries = sum(len(texts) < num_negatives for texts in negatives)
    return MiningResult(negatives, negative_scores, positive_scores.tolist(), dropped_as_positive,
                        dropped_by_margin, short_queries)


def _check_inputs(query_embeddings, positive_embeddings, corpus_embeddings, corpus_texts, queries, positives,
                  num_negatives, top_k, search) -> None:
    if not len(queries) == len(positives) == len(query_embeddings) == len(positive_embeddings):
        raise ValueError(f"{len(queries)} queries, {len(positives)} positives, {len(query_embeddings)} query and "
                         f"{len(positive_embeddings)} positive embeddings: one of each per example expected")
    if len(corpus_texts) != len(corpus_embeddings) or not corpus_texts:
        raise ValueError(f"{len(corpus_texts)} corpus texts and {len(corpus_embeddings)} corpus embeddings: a "
                         f"non-empty corpus with one embedding per text expected")
    if num_negatives <= 0 or top_k <= 0:
        raise ValueError(f"num_negatives ({num_negatives}) and top_k ({top_k}) must be positive")
    if search not in SEARCHES:
        raise ValueError(f"search={search!r} is not one of {SEARCHES}")


def _excluded_corpus_ids(corpus_texts: Sequence[str], queries: Sequence[str],
                         positives: Sequence[str]) -> list[list[int]]:
    """Per example, the corpus ids of its query's text and of every positive paired with that query text: all are
    known answers (or the question itself), never negatives."""
    corpus_ids: dict[str, list[int]] = {}
    for i, text in enumerate(corpus_texts):
        corpus_ids.setdefault(text.strip(), []).append(i)
    positives_of: dict[str, set[str]] = {}
    for query, positive in zip(queries, positives):
        positives_of.setdefault(query.strip(), set()).add(positive.strip())
    return [[i for text in {query.strip(), *positives_of[query.strip()]} for i in corpus_ids.get(text, ())]
            for query in queries]


def _is_excluded(ids: Tensor, excluded: list[list[int]], corpus_size: int) -> Tensor:
    """[rows, k] bool: whether each retrieved id is one of its row's excluded ids; (row, id) pairs become the keys
    row * corpus_size + id, so one `isin` checks the whole chunk."""
    keys = torch.tensor([row * corpus_size + i for row, row_ids in enumerate(excluded) for i in row_ids],
                        dtype=torch.long)
    return torch.isin(ids + torch.arange(len(ids)).unsqueeze(1) * corpus_size, keys)


def _search(queries: Tensor, corpus: Tensor, k: int, search: str) -> Iterator[tuple[int, Tensor, Tensor]]:
    """(first query row, scores [rows, k], corpus ids [rows, k]) per chunk of queries, best first; a chunk holds
    at most SCORE_BUDGET scores, so memory stays bounded whatever the number of queries."""
    index = _faiss_index(corpus) if search == "faiss" else None
    chunk = max(1, min(MAX_QUERY_CHUNK, SCORE_BUDGET // len(corpus)))
    for start in range(0, len(queries), chunk):
        block = queries[start:start + chunk]
        if index is None:
            scores, ids = (block @ corpus.T).topk(k, dim=1)
        else:
            scores, ids = (torch.from_numpy(a) for a in index.search(block.contiguous().numpy(), k))
        yield start, scores, ids.long()


def _faiss_index(corpus: Tensor):
    if faiss is None:
        raise ConfigError("search='faiss' needs the faiss package: pip install faiss-cpu (or faiss-gpu), "
                          "or use search=exact")
    index = faiss.IndexFlatIP(corpus.shape[1])  # inner product = cosine on unit vectors
    index.add(corpus.contiguous().numpy())
    return index
