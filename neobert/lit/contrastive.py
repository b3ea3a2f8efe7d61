"""Contrastive fine-tuning (paper Section 5.2): InfoNCE at temperature 0.07 over in-batch and hard negatives
(optionally Matryoshka: summed over truncations of the embedding), masked mean pooling, embeddings gathered across
devices WITH their gradients (so every device's queries see every device's documents as negatives), and optional
GradCache so the contrastive batch can be larger than what fits in memory at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.nn.functional import all_gather

from neobert.config import OptimizerConfig, SchedulerConfig, TrainerConfig
from neobert.config.contrastive import ContrastiveLossConfig
from neobert.data.backbone import Backbone
from neobert.layout import MATRYOSHKA_JSON
from neobert.lit.checkpoints import OPTIMIZER_NAME_KEY
from neobert.lit.optim import configure_optimizers
from neobert.lit.rng import RngState
from neobert.model.heads import pool_embeddings
from neobert.model.sentence_transformers import export_sentence_transformers


def info_nce(queries: Tensor, positives: Tensor, negatives: Tensor | None = None, temperature: float = 0.07,
             query_offset: int = 0) -> Tensor:
    """Mean InfoNCE of `queries` [B, d] against the candidates [positives; negatives] ([P, d] and [N, d]).

    Query i's positive is candidate `query_offset + i`; every other candidate (the other queries' positives:
    in-batch negatives; and all hard negatives) is a negative. Similarities are cosines / temperature.
    `query_offset` places local queries inside candidates gathered from several devices."""
    candidates = positives if negatives is None else torch.cat([positives, negatives])
    logits = F.normalize(queries.float(), dim=-1) @ F.normalize(candidates.float(), dim=-1).T / temperature
    targets = torch.arange(queries.shape[0], device=queries.device) + query_offset
    return F.cross_entropy(logits, targets)


def matryoshka_info_nce(queries: Tensor, positives: Tensor, negatives: Tensor | None, temperature: float,
                        dimension_weights: dict[int, float], query_offset: int = 0) -> tuple[Tensor, dict[int, Tensor]]:
    """sum_d w_d x InfoNCE on the first d dimensions of every embedding (Matryoshka representation learning;
    `info_nce` re-normalises each truncation). Returns the total and the per-dimension losses. One dimension
    equal to the embedding size is plain InfoNCE."""
    per_dimension = {d: info_nce(queries[:, :d], positives[:, :d], None if negatives is None else negatives[:, :d],
                                 temperature, query_offset) for d in dimension_weights}
    return sum(w * per_dimension[d] for d, w in dimension_weights.items()), per_dimension


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenates `tensor` from every process along dim 0, keeping the autograd graph: the backward pass sends
    each process the gradient that all processes' losses put on its own embeddings."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    return torch.cat(all_gather(tensor.contiguous()))


def distributed_info_nce(queries: Tensor, positives: Tensor, negatives: Tensor | None, temperature: float,
                         dimension_weights: dict[int, float] | None = None) -> tuple[Tensor, dict[int, Tensor]]:
    """(Matryoshka) InfoNCE of this process's queries against all processes' positives and hard negatives, and
    its per-dimension parts. Averaged over processes (DDP averages the gradients), it equals the loss on the
    concatenated global batch. The whole embeddings are gathered once; every truncation slices them."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    all_positives = gather_with_grad(positives)
    all_negatives = gather_with_grad(negatives) if negatives is not None else None
    return matryoshka_info_nce(queries, all_positives, all_negatives, temperature,
                               dimension_weights or {queries.shape[-1]: 1.0}, query_offset=rank * queries.shape[0])


class ContrastiveModule(L.LightningModule):
    """`batch` = {"query": {input_ids, attention_mask}, "positive": {...}, optional "negative": {...}}.

    `trainer` gives the run's length (the schedule's) and the gradient clip GradCache applies itself."""

    def __init__(self, backbone: Backbone, loss: ContrastiveLossConfig, optimizer: OptimizerConfig,
                 scheduler: SchedulerConfig, trainer: TrainerConfig):
        super().__init__()
        self.backbone = backbone
        self.loss_config, self.optimizer_config, self.scheduler_config = loss, optimizer, scheduler
        self.max_steps, self.gradient_clip_val = trainer.max_steps, trainer.gradient_clip_val
        self.automatic_optimization = loss.grad_cache_chunk_size <= 0
        self.dimension_weights = loss.dimension_weights(backbone.hidden_size)

    def embed(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids, attention_mask)
        return pool_embeddings(hidden.float(), attention_mask, "mean")

    def _loss_from_embeddings(self, embeddings: dict[str, Tensor]) -> tuple[Tensor, dict[int, Tensor]]:
        return distributed_info_nce(embeddings["query"], embeddings["positive"], embeddings.get("negative"),
                                    self.loss_config.temperature, self.dimension_weights)

    def training_step(self, batch: dict[str, dict[str, Tensor]], batch_idx: int) -> Tensor | None:
        batch_size = batch["query"]["input_ids"].shape[0]
        if self.automatic_optimization:
            loss, per_dimension = self._loss_from_embeddings(
                {side: self.embed(**inputs) for side, inputs in batch.items()})
        else:
            loss, per_dimension = self._grad_cache_step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        if len(per_dimension) > 1:
            self.log_dict({f"train/loss_dim{d}": part.detach() for d, part in per_dimension.items()},
                          batch_size=batch_size)
        self.log("train/negatives_per_query", float(self._num_candidates(batch) - 1), batch_size=batch_size)
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "record_trained_batch"):
            datamodule.record_trained_batch()  # the data position the next checkpoint saves
        return loss if self.automatic_optimization else None

    def _num_candidates(self, batch) -> int:
        world = self.trainer.world_size if self._trainer is not None else 1
        per_device = batch["positive"]["input_ids"].shape[0] + (
            batch["negative"]["input_ids"].shape[0] if "negative" in batch else 0)
        return per_device * world

    # ------------------------------------------------------------------ GradCache (Gao et al., 2021)
    def _grad_cache_step(self, batch: dict[str, dict[str, Tensor]]) -> tuple[Tensor, dict[int, Tensor]]:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        losses = self.grad_cache_backward(batch)
        self.clip_gradients(optimizer, gradient_clip_val=self.gradient_clip_val, gradient_clip_algorithm="norm")
        optimizer.step()
        scheduler.step()
        return losses

    def grad_cache_backward(self, batch: dict[str, dict[str, Tensor]]) -> tuple[Tensor, dict[int, Tensor]]:
        """Accumulates into `.grad` the gradient of the (Matryoshka) InfoNCE loss of the whole batch while holding
        the graph of one chunk at a time; returns the (detached) loss and its per-dimension parts. The loss is a
        function of the whole embeddings, so every Matryoshka truncation is in the cached gradient of step 2."""
        chunk = self.loss_config.grad_cache_chunk_size
        chunks = [(side, {k: v[i:i + chunk] for k, v in inputs.items()})
                  for side, inputs in batch.items() for i in range(0, inputs["input_ids"].shape[0], chunk)]
        # 1. Embeddings without a graph; remember each chunk's RNG state so dropout repeats in step 3.
        rng_states, cached = [], {}
        with torch.no_grad():
            for side, inputs in chunks:
                rng_states.append(RngState.capture())
                cached.setdefault(side, []).append(self.embed(**inputs))
        embeddings = {side: torch.cat(parts).requires_grad_() for side, parts in cached.items()}
        # 2. The loss and its gradient with respect to every embedding (this crosses devices via the gather).
        loss, per_dimension = self._loss_from_embeddings(embeddings)
        embedding_grads = dict(zip(embeddings, torch.autograd.grad(loss, list(embeddings.values()))))
        # 3. Re-embed chunk by chunk with a graph and push the cached gradient through each. All but the last
        # chunk use autograd.grad (parameter gradients kept aside), so the one backward that DDP sees, on the
        # last chunk, carries the whole batch's gradient and is synchronised once.
        params = [p for p in self.parameters() if p.requires_grad]
        pending = [torch.zeros_like(p) for p in params]
        offsets = {side: 0 for side in embeddings}
        for number, ((side, inputs), rng) in enumerate(zip(chunks, rng_states)):
            size = inputs["input_ids"].shape[0]
            grad = embedding_grads[side][offsets[side]:offsets[side] + size]
            offsets[side] += size
            with rng.restored():
                surrogate = (self.embed(**inputs) * grad).sum()
            if number < len(chunks) - 1:
                for acc, g in zip(pending, torch.autograd.grad(surrogate, params, allow_unused=True)):
                    if g is not None:
                        acc.add_(g)
            else:
                surrogate = surrogate + sum((p * acc).sum() for p, acc in zip(params, pending))
                self.manual_backward(surrogate)
        return loss.detach(), {d: part.detach() for d, part in per_dimension.items()}

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        return configure_optimizers(self.backbone, self.optimizer_config, self.scheduler_config, self.max_steps)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[OPTIMIZER_NAME_KEY] = self.optimizer_config.name  # a resume with another one is refused

    def export(self, directory: str | Path) -> Path:
        """Writes the encoder in our hub layout plus the sentence-transformers files (one directory serves both:
        `load_backbone(dir)` and `SentenceTransformer(dir)`), and after Matryoshka training `matryoshka.json`:
        the truncations it was trained for (`experiments.mteb --dim`, `SentenceTransformer(dir, truncate_dim=d)`)."""
        directory = export_sentence_transformers(self.backbone.encoder, self.backbone.tokenizer, directory)
        if self.loss_config.matryoshka_dims:
            (directory / MATRYOSHKA_JSON).write_text(json.dumps({
                "dims": list(self.dimension_weights), "weights": list(self.dimension_weights.values())}) + "\n")
        return directory
