"""Contrastive fine-tuning (NEOBERT_SPEC section 5): InfoNCE at temperature 0.07 over in-batch and hard
negatives, masked mean pooling, embeddings gathered across devices WITH their gradients (so every device's
queries see every device's documents as negatives), and optional GradCache so the contrastive batch can be
larger than what fits in memory at once.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from neobert.data.contrastive import ContrastiveDataConfig, ContrastiveDataModule
from neobert.lit.optim import build_adamw, warmup_linear
from neobert.model.backbone import Backbone
from neobert.model.modeling import pool_embeddings


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


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenates `tensor` from every process along dim 0, keeping the autograd graph: the backward pass sends
    each process the gradient that all processes' losses put on its own embeddings."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous()))


def distributed_info_nce(queries: Tensor, positives: Tensor, negatives: Tensor | None,
                         temperature: float) -> Tensor:
    """InfoNCE of this process's queries against all processes' positives and hard negatives. Averaged over
    processes (DDP averages the gradients), it equals `info_nce` on the concatenated global batch."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    all_positives = gather_with_grad(positives)
    all_negatives = gather_with_grad(negatives) if negatives is not None else None
    return info_nce(queries, all_positives, all_negatives, temperature, query_offset=rank * queries.shape[0])


@dataclass
class ContrastiveConfig:
    temperature: float = 0.07
    lr: float = 2e-5
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 100
    max_steps: int = 2000
    gradient_clip: float = 1.0
    # GradCache: embed the batch in chunks of this many texts without a graph, take the loss gradient on the
    # embeddings, then re-embed chunk by chunk with a graph. 0 = off (one ordinary forward/backward).
    grad_cache_chunk_size: int = 0


class ContrastiveModule(L.LightningModule):
    """`batch` = {"query": {input_ids, attention_mask}, "positive": {...}, optional "negative": {...}}."""

    def __init__(self, backbone: Backbone, config: ContrastiveConfig):
        super().__init__()
        self.backbone = backbone
        self.config = config
        self.automatic_optimization = config.grad_cache_chunk_size <= 0

    def embed(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids, attention_mask)
        return pool_embeddings(hidden.float(), attention_mask, "mean")

    def _loss_from_embeddings(self, embeddings: dict[str, Tensor]) -> Tensor:
        return distributed_info_nce(embeddings["query"], embeddings["positive"], embeddings.get("negative"),
                                    self.config.temperature)

    def training_step(self, batch: dict[str, dict[str, Tensor]], batch_idx: int) -> Tensor | None:
        batch_size = batch["query"]["input_ids"].shape[0]
        if self.automatic_optimization:
            loss = self._loss_from_embeddings({side: self.embed(**inputs) for side, inputs in batch.items()})
        else:
            loss = self._grad_cache_step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/negatives_per_query", float(self._num_candidates(batch) - 1), batch_size=batch_size)
        return loss if self.automatic_optimization else None

    def _num_candidates(self, batch) -> int:
        world = self.trainer.world_size if self._trainer is not None else 1
        per_device = batch["positive"]["input_ids"].shape[0] + (
            batch["negative"]["input_ids"].shape[0] if "negative" in batch else 0)
        return per_device * world

    # ------------------------------------------------------------------ GradCache (Gao et al., 2021)
    def _grad_cache_step(self, batch: dict[str, dict[str, Tensor]]) -> Tensor:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        loss = self.grad_cache_backward(batch)
        self.clip_gradients(optimizer, gradient_clip_val=self.config.gradient_clip, gradient_clip_algorithm="norm")
        optimizer.step()
        scheduler.step()
        return loss

    def grad_cache_backward(self, batch: dict[str, dict[str, Tensor]]) -> Tensor:
        """Accumulates into `.grad` the gradient of the InfoNCE loss of the whole batch while holding the graph of
        one chunk at a time; returns the (detached) loss."""
        chunk = self.config.grad_cache_chunk_size
        chunks = [(side, {k: v[i:i + chunk] for k, v in inputs.items()})
                  for side, inputs in batch.items() for i in range(0, inputs["input_ids"].shape[0], chunk)]
        # 1. Embeddings without a graph; remember each chunk's RNG state so dropout repeats in step 3.
        rng_states, cached = [], {}
        with torch.no_grad():
            for side, inputs in chunks:
                rng_states.append(_RngState.capture(self.device))
                cached.setdefault(side, []).append(self.embed(**inputs))
        embeddings = {side: torch.cat(parts).requires_grad_() for side, parts in cached.items()}
        # 2. The loss and its gradient with respect to every embedding (this crosses devices via the gather).
        loss = self._loss_from_embeddings(embeddings)
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
        return loss.detach()

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        optimizer = build_adamw(self.backbone, lr=self.config.lr, weight_decay=self.config.weight_decay,
                                betas=tuple(self.config.betas), eps=self.config.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_linear(self.config.warmup_steps, self.config.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def export(self, directory: str | Path) -> Path:
        """Writes the encoder in our hub layout plus the sentence-transformers files (one directory serves both:
        `load_backbone(dir)` and `SentenceTransformer(dir)`)."""
        from neobert.eval.sentence_transformers_export import export_sentence_transformers

        return export_sentence_transformers(self.backbone, directory)


@dataclass
class _RngState:
    cpu: Tensor
    cuda: Optional[Tensor]
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> "_RngState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    @contextlib.contextmanager
    def restored(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


# ----------------------------------------------------------------------------------------------- a run


@dataclass
class ContrastiveTrainerConfig:
    accelerator: str = "auto"
    devices: int = 1  # negatives grow with the devices: every device's documents are gathered
    strategy: str = "auto"  # "ddp" for several devices
    precision: str = "bf16-mixed"  # "32-true" on CPU
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    seed: int = 0


@dataclass
class ContrastiveRunConfig:
    model: str = "chandar-lab/NeoBERT"  # our checkpoint dir, any HF encoder dir or hub name, or preset:<name>
    tokenizer: Optional[str] = None
    data: ContrastiveDataConfig = field(default_factory=ContrastiveDataConfig)
    train: ContrastiveConfig = field(default_factory=ContrastiveConfig)
    trainer: ContrastiveTrainerConfig = field(default_factory=ContrastiveTrainerConfig)
    # A local STS file (STS Benchmark layout) scored before and after training: the zero-shot vs tuned check.
    eval_sts: Optional[str] = None
    output_dir: str = "runs/contrastive"


def run_contrastive(config: ContrastiveRunConfig) -> dict:
    """Fine-tunes, exports to `<output_dir>/export` (hub + sentence-transformers layout) and returns the
    summary (also in `<output_dir>/result.json`)."""
    from neobert.eval.mteb import DEFAULT_INSTRUCTIONS, LocalSTSTask, MtebEncoder, TaskInstructions, run_mteb
    from neobert.model.backbone import load_backbone

    L.seed_everything(config.trainer.seed, workers=True)
    output_dir = Path(config.output_dir)
    backbone = load_backbone(config.model, tokenizer=config.tokenizer)
    datamodule = ContrastiveDataModule(config.data, backbone.tokenizer)
    datamodule.setup("fit")  # reads (or fails to reach) every data set before the model work starts

    # The local STS task gets the instruction MTEB's STS tasks get (as STSBenchmark in the instruction file).
    sts_instruction = TaskInstructions.load(DEFAULT_INSTRUCTIONS).for_task("STSBenchmark")
    instructions = TaskInstructions(query={"ContrastiveEvalSTS": sts_instruction})

    def sts_score(tag: str) -> Optional[float]:
        if config.eval_sts is None:
            return None
        task = LocalSTSTask(config.eval_sts, name="ContrastiveEvalSTS")
        report = run_mteb(MtebEncoder(backbone, instructions, batch_size=config.data.batch_size, name=config.model),
                          [task], output_dir / f"sts_{tag}", config.data.batch_size, show_progress_bar=False)
        return report["tasks"]["ContrastiveEvalSTS"]["main_score"]

    before = sts_score("zero_shot")
    module = ContrastiveModule(backbone, config.train)
    automatic = module.automatic_optimization
    trainer = L.Trainer(
        accelerator=config.trainer.accelerator, devices=config.trainer.devices, strategy=config.trainer.strategy,
        precision=config.trainer.precision, max_steps=config.train.max_steps,
        gradient_clip_val=config.train.gradient_clip if automatic else None,
        # Each rank takes its own slice of the same global batch (ContrastiveBatchSampler).
        use_distributed_sampler=False,
        logger=L.pytorch.loggers.CSVLogger(output_dir, name="logs", version=""),
        log_every_n_steps=config.trainer.log_every_n_steps, enable_progress_bar=config.trainer.enable_progress_bar,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=output_dir)
    trainer.fit(module, datamodule=datamodule)
    export_dir = None
    if trainer.is_global_zero:
        export_dir = module.export(output_dir / "export")
    after = sts_score("tuned") if trainer.is_global_zero else None
    result = {"model": config.model, "steps": trainer.global_step, "export": str(export_dir),
              "sts_zero_shot": before, "sts_tuned": after,
              "datasets": [c.name for c in datamodule.corpora]}
    if trainer.is_global_zero:
        (output_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
