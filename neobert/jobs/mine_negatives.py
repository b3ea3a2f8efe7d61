"""Hard-negative mining, the whole job (`python -m experiments.mine_negatives`): read (query, positive) examples and
a corpus, embed them with any supported encoder, mine each query's hard negatives
(`neobert.data.mining.mine_hard_negatives`), and write them as jsonl rows

    {"query": ..., "positive": ..., "negatives": [...], "negative_scores": [...], "positive_score": ...}

(a layout `neobert.data.contrastive.read_local_examples` reads back) with `<output stem>.report.json` beside them:
the config, what was dropped and the mean scores. Texts are written without the instructions used to embed them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from neobert.config.mining import MiningConfig
from neobert.data.backbone import check_model_name, load_backbone
from neobert.data.contrastive import prepend_instruction, read_local_examples
from neobert.data.mining import mine_hard_negatives
from neobert.errors import ConfigError, DataError
from neobert.hub import require_hub
from neobert.layout import write_atomically

log = logging.getLogger(__name__)

REPORT_SUFFIX = ".report.json"
BATCHES_PER_PROGRESS_STEP = 16  # the backbone embedder updates its progress bar every this many batches

Embedder = Callable[[list[str]], Tensor]  # texts -> unit vectors [N, d], float32 on CPU


def run_mining(config: MiningConfig) -> dict:
    config.validate()  # also when built in Python rather than loaded from YAML
    started = time.perf_counter()
    examples = read_local_examples(config.input, config.sts_min_score)
    if not examples:
        raise DataError(f"input={config.input!r} holds no (query, positive) examples (STS layouts keep the pairs "
                        f"scoring >= sts_min_score={config.sts_min_score})")
    queries, positives = [e.query for e in examples], [e.positive for e in examples]
    corpus = read_corpus(config.corpus) if config.corpus else list(dict.fromkeys(queries + positives))
    log.info("mining %d queries against a corpus of %d texts", len(queries), len(corpus))

    embedder = resolve_embedder(config)
    texts = [prepend_instruction(config.query_instruction, q) for q in queries]
    texts += [prepend_instruction(config.document_instruction, d) for d in positives + corpus]
    embeddings = embed_distinct(build_embedder(config, embedder), texts)
    query_embeddings, positive_embeddings, corpus_embeddings = embeddings.split(
        [len(queries), len(positives), len(corpus)])
    result = mine_hard_negatives(query_embeddings, positive_embeddings, corpus_embeddings, corpus, queries,
                                 positives, num_negatives=config.num_negatives, top_k=config.top_k,
                                 skip_top=config.skip_top, margin=config.margin,
                                 max_score_ratio=config.max_score_ratio, search=config.search)

    output = Path(config.output)
    rows = zip(queries, positives, result.negatives, result.negative_scores, result.positive_scores)
    write_atomically(output, (json.dumps({"query": q, "positive": p, "negatives": n,
                                          "negative_scores": [round(s, 6) for s in scores],
                                          "positive_score": round(score, 6)}, ensure_ascii=False) + "\n"
                              for q, p, n, scores, score in rows))
    kept_scores = [s for scores in result.negative_scores for s in scores]
    report = {
        "config": asdict(config),
        "embedder": embedder,
        "queries": len(queries),
        "corpus_size": len(corpus),
        "negatives_written": len(kept_scores),
        "dropped_as_query_or_positive": result.dropped_as_positive,
        "dropped_by_margin": result.dropped_by_margin,
        "queries_with_fewer_negatives": result.short_queries,
        "mean_positive_score": sum(result.positive_scores) / len(queries),
        "mean_negative_score": sum(kept_scores) / len(kept_scores) if kept_scores else None,
        "seconds": round(time.perf_counter() - started, 1),
        "output": str(output),
    }
    report_path = output.with_name(output.stem + REPORT_SUFFIX)
    write_atomically(report_path, [json.dumps(report, indent=2) + "\n"])
    log.info("%d negatives for %d queries (%d queries short of %d); dropped: %d as the query or a positive, %d "
             "by the margin; wrote %s and %s", len(kept_scores), len(queries), result.short_queries,
             config.num_negatives, result.dropped_as_positive, result.dropped_by_margin, output, report_path)
    return report


def read_corpus(path: str) -> list[str]:
    """The distinct, non-blank documents of a .txt (one a line) or a .jsonl (a `text` column)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"corpus={str(path)!r} is not UTF-8 text: {err}") from err
    if path.suffix == ".jsonl":
        lines = [_jsonl_text(line, path, number) for number, line in enumerate(lines, 1) if line.strip()]
    documents = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    if not documents:
        raise DataError(f"corpus={str(path)!r} holds no documents")
    return documents


def _jsonl_text(line: str, path: Path, number: int) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"corpus={str(path)!r}, line {number}: not a JSON object: {err}") from err
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise DataError(f"corpus={str(path)!r}, line {number}: expected an object with a string `text` column")
    return row["text"]


def resolve_embedder(config: MiningConfig) -> str:
    """`auto`: sentence-transformers for a directory it wrote (modules.json), else our backbone + mean pooling."""
    if config.embedder != "auto":
        return config.embedder
    return "sentence-transformers" if (Path(config.model) / "modules.json").is_file() else "backbone"


def build_embedder(config: MiningConfig, embedder: str) -> Embedder:
    torch.manual_seed(config.seed)  # the random weights of a preset:<name> model
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if embedder == "sentence-transformers":
        return _sentence_transformers_embedder(config, device)
    from neobert.eval.mteb import embed_texts, resolve_length_limit  # imports mteb (heavy): the backbone embedder only

    backbone = load_backbone(config.model, tokenizer=config.tokenizer, **config.model_overrides).to(device)
    max_length = resolve_length_limit(backbone, config.max_length).tokens  # once, not per block of texts
    dtype = torch.bfloat16 if device.type == "cuda" else None  # as the MTEB evaluation: bf16 on GPU only
    block = config.batch_size * BATCHES_PER_PROGRESS_STEP

    def embed(texts: list[str]) -> Tensor:
        parts = []
        with tqdm(total=len(texts), desc="embedding", unit="text") as progress:
            for start in range(0, len(texts), block):
                parts.append(embed_texts(backbone, texts[start:start + block], config.batch_size, max_length, device,
                                         dtype))
                progress.update(len(parts[-1]))
        return F.normalize(torch.cat(parts), dim=-1)

    return embed


def _sentence_transformers_embedder(config: MiningConfig, device: torch.device) -> Embedder:
    if config.tokenizer is not None:
        raise ConfigError("invalid config key 'tokenizer': a sentence-transformers model brings its own; unset it "
                          "or use embedder=backbone")
    if not Path(config.model).exists():
        check_model_name(config.model)
        require_hub(config.model, "model")
    from sentence_transformers import SentenceTransformer  # heavy: only for sentence-transformers models

    model = SentenceTransformer(config.model, device=str(device))
    if config.max_length is not None:
        model.max_seq_length = config.max_length

    def embed(texts: list[str]) -> Tensor:
        vectors = model.encode(texts, batch_size=config.batch_size, normalize_embeddings=True,
                               convert_to_numpy=True, show_progress_bar=True)
        return torch.from_numpy(vectors).float()

    return embed


def embed_distinct(embed: Embedder, texts: list[str]) -> Tensor:
    """Embeddings of `texts`, each distinct text encoded once (a positive is usually a corpus text too)."""
    distinct = list(dict.fromkeys(texts))
    row_of = {text: row for row, text in enumerate(distinct)}
    log.info("embedding %d distinct texts (%d in all)", len(distinct), len(texts))
    return embed(distinct)[torch.tensor([row_of[text] for text in texts], dtype=torch.long)]
