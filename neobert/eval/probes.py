"""Quick looks into a pretrained checkpoint (an export directory), used by the ablation notebook: fill-mask
predictions, sentence-embedding similarities, and the pseudo-perplexity of a ladder's checkpoints against
document length (paper Figure 2 over the ablation ladder)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from neobert.config.pseudo_perplexity import PseudoPerplexityConfig
from neobert.data.backbone import load_backbone
from neobert.eval.pseudo_perplexity import BucketScore, load_model_and_tokenizer, run_pseudo_perplexity
from neobert.model.modeling import pool_embeddings


def load_mlm(export_dir: str | Path):
    """(NeoBERTForMaskedLM in eval mode, its tokenizer) from an export directory."""
    model, tokenizer = load_model_and_tokenizer(str(export_dir))
    return model.eval(), tokenizer


def fill_mask(export_dir: str | Path, text: str, top_k: int = 5) -> list[list[tuple[str, float]]]:
    """Top-k predictions with probabilities for every [MASK] in `text` ("[MASK]" is replaced by the checkpoint's
    own mask token, so the same sentence probes WordPiece and BPE checkpoints)."""
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
    """Cosine similarities [n, n] (a NumPy array) between mean-pooled sentence embeddings of the checkpoint's
    encoder."""
    backbone = load_backbone(str(export_dir)).eval()
    batch = backbone.tokenizer(list(sentences), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = backbone(batch["input_ids"], batch["attention_mask"])
    embeddings = torch.nn.functional.normalize(pool_embeddings(hidden, batch["attention_mask"], "mean"), dim=-1)
    return (embeddings @ embeddings.T).numpy()


def ladder_pseudo_perplexity(results: Sequence[dict], corpus: str | Path, bucket_edges: Sequence[int],
                             docs_per_bucket: int = 2, steps: Sequence[str] | None = None) -> list[BucketScore]:
    """Per-bucket pseudo-perplexity of the ladder's checkpoints (rows of its results.json) on `corpus`, a local
    .jsonl file with a `content` column (Figure 2 over the ladder). Only comparable between checkpoints that
    share a tokenizer."""
    chosen = [r for r in results if steps is None or r["step"] in steps]
    config = PseudoPerplexityConfig(models=[r["export_dir"] for r in chosen], bucket_edges=list(bucket_edges),
                                    docs_per_bucket=docs_per_bucket, device="cpu")
    config.data.source = str(corpus)
    config.data.hub_config = None
    config.data.text_column = "content"
    _, buckets = run_pseudo_perplexity(config)
    return buckets
