"""The pretraining loop's arithmetic held against a plain PyTorch loop written from torch primitives: from the same
initial weights and the same masked documents, a few optimizer steps through MLMPretrainingModule and the suite's
Trainer (unpadded batches, masked-only logits, fused AdamW) and through a loop of padded batches, full logits,
torch's AdamW with decay on matrices only, the warm-up-cosine factor, gradient-norm clipping and the loss divided
by the accumulation give the same losses, weights and last gradients (fp32), with and without accumulation. Adam and
clipping hide a gradient's scale from the weights: the last gradients, unclipped, show it."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from neobert.config import load_config
from neobert.config.pretrain import PretrainConfig
from neobert.data.demo_corpus import demo_documents
from neobert.data.masking import MLMMasker
from neobert.data.tokenizer import load_tokenizer
from neobert.jobs.pretrain import build_model_config
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.lit.trainer import build_trainer
from neobert.model import NeoBERTForMaskedLM
from neobert.model.heads import IGNORE_INDEX

STEPS, DOCUMENTS_PER_BATCH, MAX_LENGTH = 4, 4, 32


class RecordingModule(MLMPretrainingModule):
    """Keeps every micro-batch's loss (the model's mean over its masked tokens)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict, batch_idx: int):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


def pretraining_config(accumulate: int, clip: float) -> PretrainConfig:
    return load_config(PretrainConfig, None, [
        "model.preset=tiny", "model.overrides.max_length=64", f"data.max_length={MAX_LENGTH}",
        "trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32-true", f"trainer.max_steps={STEPS}",
        f"trainer.accumulate_grad_batches={accumulate}", f"trainer.micro_batch_size={DOCUMENTS_PER_BATCH}",
        f"trainer.gradient_clip_val={clip}", "optimizer.lr=3e-3", "scheduler.warmup_steps=1",
        "scheduler.decay_fraction=1.0", "logging.progress_bar=false", "logging.log_every_n_steps=1",
        "logging.loggers=[]"])


def masked_batches(tokenizer, count: int) -> list[tuple[dict, dict]]:
    """(unpadded, padded) pairs of the same documents with the same masked positions (the same generator draws)."""
    texts = [doc["content"] for doc in demo_documents()[: count * DOCUMENTS_PER_BATCH]]
    ids = [row[:MAX_LENGTH] for row in tokenizer(texts)["input_ids"]]
    masker = MLMMasker.from_tokenizer(tokenizer, rate=0.3)
    pairs = []
    for i in range(count):
        docs = ids[i * DOCUMENTS_PER_BATCH: (i + 1) * DOCUMENTS_PER_BATCH]
        unpadded = masker.collate_unpadded(docs, torch.Generator().manual_seed(i))
        pairs.append((unpadded, masker.collate_padded(docs, torch.Generator().manual_seed(i))))
    return pairs


def warmup_cosine_to_a_tenth(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def plain_pytorch_loop(model: NeoBERTForMaskedLM, batches: list[dict], config: PretrainConfig) -> list[torch.Tensor]:
    """The reference: padded batches, full logits, cross-entropy over the masked tokens; per optimizer step the
    micro-batches' losses / accumulation summed into the gradients, clipped by norm, one AdamW step, one lr step."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in embeddings]
    others = [p for p in model.parameters() if p.ndim < 2 or id(p) in embeddings]
    optim = config.optimizer
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": optim.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=optim.lr, betas=optim.betas,
                                  eps=optim.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_to_a_tenth(step, config.scheduler.warmup_steps, STEPS))
    accumulate, losses = config.trainer.accumulate_grad_batches, []
    model.train()
    for step in range(STEPS):
        optimizer.zero_grad()
        for batch in batches[step * accumulate: (step + 1) * accumulate]:
            logits = model(batch["input_ids"], batch["attention_mask"]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                   ignore_index=IGNORE_INDEX)
            (loss / accumulate).backward()
            losses.append(loss.detach())
        if config.trainer.gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.trainer.gradient_clip_val)
        optimizer.step()
        schedule.step()
    return losses


@pytest.mark.parametrize("accumulate, clip", [(1, 0.5), (2, 0.5), (2, 0.0)])
def test_the_lightning_loop_matches_a_plain_pytorch_loop(accumulate, clip):
    config = pretraining_config(accumulate, clip)
    tokenizer = load_tokenizer(config.data.tokenizer)
    pairs = masked_batches(tokenizer, STEPS * accumulate)
    torch.manual_seed(0)
    module = RecordingModule(config, build_model_config(config, tokenizer), tokenizer)
    reference = NeoBERTForMaskedLM(dataclasses.replace(module.model.config, attention_backend="sdpa"))
    initial = copy.deepcopy(module.model.state_dict())
    reference.load_state_dict(initial)

    trainer = build_trainer(config.trainer, config.logging, None, max_epochs=-1)
    trainer.fit(module, train_dataloaders=DataLoader([unpadded for unpadded, _ in pairs], batch_size=None))
    expected = plain_pytorch_loop(reference, [padded for _, padded in pairs], config)

    assert trainer.global_step == STEPS and len(module.losses) == len(expected) == STEPS * accumulate
    torch.testing.assert_close(torch.stack(module.losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    trained, plain = dict(module.model.named_parameters()), dict(reference.named_parameters())
    assert min(float((trained[name].detach() - initial[name]).abs().max()) for name in trained) > 1e-3  # all trained
    for name, param in plain.items():
        torch.testing.assert_close(trained[name], param, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(trained[name].grad, param.grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m: f"{name}.grad: {m}")
