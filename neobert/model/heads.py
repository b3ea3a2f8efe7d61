"""What reads an encoder's hidden states, independent of the encoder under them: the task heads every classifier of
this suite mixes in (NeoBERT's own, the one over any Hugging Face encoder, the `transformers` wrappers), the paper's
sequence classification head and a label per token (NER), with their outputs and losses; sentence embeddings by
pooling; the MLM decoder's matmul on a padded vocabulary (`padded_linear`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100


@dataclass
class SequenceClassifierOutput:
    logits: Tensor
    loss: Tensor | None = None
    last_hidden_state: Tensor | None = None


class ClassificationHead:
    """The paper's classification head, mixed into every classifier of this suite (NeoBERT's, the one over any
    Hugging Face encoder, the `transformers` wrapper): [CLS] -> dropout -> dense -> tanh -> dropout -> classifier,
    MSE when num_labels == 1. Its layers are attributes of the model itself (`dense`, `classifier`), the hub's
    tensor names."""

    def add_classification_head(self, hidden_size: int, num_labels: int, dropout: float, init_range: float) -> None:
        self.num_labels = num_labels
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.classifier = nn.Linear(hidden_size, num_labels)
        self.head_dropout = nn.Dropout(dropout)
        for layer in (self.dense, self.classifier):
            nn.init.normal_(layer.weight, mean=0.0, std=init_range)
            nn.init.zeros_(layer.bias)

    def classify(self, hidden: Tensor, labels: Tensor | None = None) -> SequenceClassifierOutput:
        x = self.head_dropout(hidden[:, 0])  # [CLS]
        x = self.head_dropout(torch.tanh(self.dense(x)))
        logits = self.classifier(x)
        loss = None if labels is None else classification_loss(logits, labels, self.num_labels)
        return SequenceClassifierOutput(logits, loss, hidden)


def classification_loss(logits: Tensor, labels: Tensor, num_labels: int) -> Tensor:
    """MSE for regression (num_labels == 1), cross-entropy otherwise; out-of-range labels are an error."""
    if num_labels == 1:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    if labels.dtype.is_floating_point:
        raise ValueError(f"classification labels must be integers, got dtype {labels.dtype}")
    if bool(((labels < 0) | (labels >= num_labels)).any()):
        raise ValueError(f"labels must be in [0, {num_labels}); got {sorted(set(labels.tolist()))}")
    return F.cross_entropy(logits.float(), labels)


def pool_embeddings(hidden: Tensor, attention_mask: Tensor | None, mode: str = "mean") -> Tensor:
    """Sentence embeddings: masked mean over real tokens (the paper's MTEB choice) or the first token."""
    if mode == "cls":
        return hidden[:, 0]
    if mode != "mean":
        raise ValueError(f"pooling must be 'mean' or 'cls', got {mode!r}")
    if attention_mask is None:
        return hidden.mean(dim=1)
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


@dataclass
class TokenClassifierOutput:
    logits: Tensor  # [B, L, num_labels]
    loss: Tensor | None = None
    last_hidden_state: Tensor | None = None


class TokenClassificationHead:
    """A label per token (NER): dropout -> classifier on every position, cross-entropy over the positions whose
    label is not IGNORE_INDEX (the first sub-token of each word). Mixed into NeoBERT's token classifier and the
    `transformers` wrapper; the layer is the hub's `classifier`."""

    def add_token_classification_head(self, hidden_size: int, num_labels: int, dropout: float,
                                      init_range: float) -> None:
        self.num_labels = num_labels
        self.head_dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_labels)
        nn.init.normal_(self.classifier.weight, mean=0.0, std=init_range)
        nn.init.zeros_(self.classifier.bias)

    def tag(self, hidden: Tensor, labels: Tensor | None = None) -> TokenClassifierOutput:
        logits = self.classifier(self.head_dropout(hidden))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, self.num_labels), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return TokenClassifierOutput(logits, loss, hidden)


def padded_linear(x: Tensor, weight: Tensor, bias: Tensor | None, multiple: int) -> Tensor:
    """F.linear(x, weight, bias) computed with the weight's rows (the output features) padded with zeros to a multiple
    of `multiple`, the output's real features returned (a view). Each output feature is its own dot product, so the
    values are the unpadded ones; the output's rows are aligned for the GEMM, at the cost of a padded copy of the weight
    per call and, in the backward, of the output gradient's padded copy."""
    extra = -weight.shape[0] % multiple
    if not extra:
        return F.linear(x, weight, bias)
    # cast before padding: a 16-bit padded copy, not a float32 one. A meta forward has no autocast to ask about
    # (torch.amp.is_autocast_available would say so, but Dynamo cannot trace it: a graph break in a compiled head)
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    padded_bias = None if bias is None else F.pad(bias, (0, extra))
    return F.linear(x, F.pad(weight, (0, 0, 0, extra)), padded_bias)[..., : weight.shape[0]]
