"""NeoBERT in plain PyTorch: the encoder, its MLM head and its classifiers (their heads: `neobert.model.heads`).

Module and parameter names follow the official hub code (chandar-lab/NeoBERT) so its `model.safetensors`
loads with no renaming: `encoder` (token embedding), `transformer_encoder.{i}.{qkv,wo,ffn.w12,ffn.w3,
attention_norm,ffn_norm}`, `layer_norm` (final norm); heads `decoder` (MLM) and `dense`/`classifier`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neobert.model import checkpoint
from neobert.model.attention import AttentionLayout, attend, position_ids_from_cu_seqlens
from neobert.model.rope import RotaryTables, apply_rope, rope_tables
from neobert.model.config import NeoBERTConfig
from neobert.model.heads import (IGNORE_INDEX, ClassificationHead, SequenceClassifierOutput, TokenClassificationHead,
                                 TokenClassifierOutput, padded_linear)
from neobert.model.kernels import CUDA_GRAPH_MODES, WITHOUT_CUDA_GRAPHS, fuses_mlm_loss, liger_linear_cross_entropy
from neobert.model.layers import GeluMLP, SwiGLU, make_norm


@dataclass
class EncoderOutput:
    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None


@dataclass
class MaskedLMOutput:
    # [..., vocab], or [n_masked, vocab] when computed at masked positions only; None where the loss was fused with
    # the decoder (fused_mlm_loss in training), which never makes them: `predictions` holds their argmax instead
    logits: Tensor | None
    loss: Tensor | None = None
    last_hidden_state: Tensor | None = None
    masked_positions: Tensor | None = None  # bool, input shape; set when logits are masked-only (masked_only)
    masked_index: Tensor | None = None  # flat indices of the logits' positions (masked_index)
    predictions: Tensor | None = None  # the fused loss's argmax token per scored row (-1 for rows labelled -100)

    def predicted_ids(self) -> Tensor:
        """The most likely token of every row the head scored: from the logits, or the fused loss's predictions (max's
        indices: cheaper than argmax on bf16 logits on a CPU, the same first of equal maxima)."""
        return self.logits.max(-1).indices if self.logits is not None else self.predictions


# ---------------------------------------------------------------------------------------------- blocks
class EncoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout_p = config.dropout
        self.attention_kernel = config.attention_kernel
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if config.activation == "swiglu":
            self.ffn = SwiGLU(config.hidden_size, config.ffn_hidden_size, kernels=config.kernels)
        else:  # no fused GELU: always eager
            self.ffn = GeluMLP(config.hidden_size, config.ffn_hidden_size)
        self.attention_norm = make_norm(config)
        self.ffn_norm = make_norm(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, layout: AttentionLayout, rope: RotaryTables | None) -> Tensor:
        h = self.attention_norm(x)
        # The hub layout interleaves q, k, v per head: view as [..., heads, 3 * head_dim] and split the last axis.
        qk, v = self.qkv(h).unflatten(-1, (self.num_heads, 3 * self.head_dim)).split(
            (2 * self.head_dim, self.head_dim), dim=-1)
        if rope is not None:
            qk = apply_rope(qk, rope)  # q and k in one pass, faster than two
        q, k = qk.chunk(2, dim=-1)
        attn = attend(q, k, v, layout, self.dropout_p if self.training else 0.0, self.attention_kernel)
        x = x + self.dropout(self.wo(attn.flatten(-2)))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


# ---------------------------------------------------------------------------------------------- models
class NeoBERTPreTrained(nn.Module):
    """Shared by the encoder and its heads: config, weight init, hub-format save/load."""

    config: NeoBERTConfig
    # True: the forward checks input values (token ids, masks, labels) and looks whether a padded batch has padding
    # (to skip the mask, or to unpad it for varlen), which reads device values on the host. False (the training
    # loop, `set_validate_inputs(False)`): it reads nothing back, so a GPU step never waits for the host.
    validate_inputs: bool = True

    def set_validate_inputs(self, enabled: bool) -> None:
        """Sets `validate_inputs` on this model and every NeoBERT module inside it."""
        for module in self.modules():
            if isinstance(module, NeoBERTPreTrained):
                module.validate_inputs = enabled

    def _reads_device(self) -> bool:
        """Whether the forward may read device values on the host (never inside a compiled graph)."""
        return self.validate_inputs and not torch.compiler.is_compiling()

    def compile(self, *args, scope: str = "model", **kwargs) -> None:
        """`torch.compile` in place (`nn.Module.compile`'s arguments). scope="blocks" compiles each encoder block on
        its own (regional compilation): the blocks share one compiled graph, so compiling costs one block's time, not
        the whole depth's; the embedding and the heads run eager, but for the MLM head's decoder and loss over the
        masked rows (`NeoBERTForMaskedLM.score_masked_rows`), compiled too unless fused_mlm_loss fuses them.
        scope="model": one graph of the whole forward, the head's loss included."""
        if scope == "model":
            super().compile(*args, **kwargs)
        elif scope == "blocks":
            encoder = self if isinstance(self, NeoBERT) else self.model
            for block in encoder.transformer_encoder:
                block.compile(*args, **kwargs)
            if isinstance(self, NeoBERTForMaskedLM) and not self.config.fused_mlm_loss:
                self.compile_masked_scoring(**kwargs)
            # Made by the first block, the compiled rotation's tables are a side effect of its graph and a guard
            # that gives it a graph of its own; made before it, an input of every block's graph, which CUDA graphs
            # copy into each block's own buffer at every replay (they keep in place only weights and the outputs of
            # an earlier graph, as the first block's tables are)
            encoder.rotation_tables_first = kwargs.get("mode") not in CUDA_GRAPH_MODES
        else:
            raise ValueError(f"compile scope must be 'model' or 'blocks', got {scope!r}")

    def init_weights(self) -> None:
        self.apply(self._init_module)

    def _init_module(self, module: nn.Module) -> None:
        # The released code: uniform(-r, r) for Linear and Embedding weights, zero biases.
        if isinstance(module, nn.Linear):
            nn.init.uniform_(module.weight, -self.config.decoder_init_range, self.config.decoder_init_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.uniform_(module.weight, -self.config.embedding_init_range, self.config.embedding_init_range)
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        skip = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if not (exclude_embeddings and id(p) in skip))

    def save_pretrained(self, directory: str | os.PathLike, tokenizer=None) -> None:
        checkpoint.save_pretrained(self, directory, tokenizer=tokenizer)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **config_overrides):
        return checkpoint.load_pretrained(cls, directory, **config_overrides)


class NeoBERT(NeoBERTPreTrained):
    """The encoder: token embedding, pre-norm blocks, final norm. Returns hidden states after the final norm."""

    hub_architecture = "NeoBERT"
    rotation_tables_first: bool = False  # compile(scope="blocks") without CUDA graphs: tables made before the blocks

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.config = config
        self.encoder = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        if config.position_encoding == "learned":
            self.positional_embedding = nn.Embedding(config.max_length, config.hidden_size)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.transformer_encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_hidden_layers))
        self.layer_norm = make_norm(config)
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Padded batches: input_ids [B, L] with a 1/0 attention_mask [B, L] (1 = real token).

        Packed batches: input_ids of any shape holding documents end to end, with `cu_seqlens`
        (int [n_docs + 1], cumulative lengths over the flattened ids); positions restart per document.
        With the `varlen` backend a padded batch is unpadded internally, so pad tokens cost no compute.
        """
        self._check_inputs(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        if cu_seqlens is not None:
            flat = input_ids.reshape(-1)
            layout = AttentionLayout.from_cu_seqlens(cu_seqlens, max_seqlen, total=flat.numel())
            if position_ids is None:
                position_ids = position_ids_from_cu_seqlens(layout.cu_seqlens, total=flat.numel())
            hidden, states = self._run(flat, position_ids.reshape(-1), layout, output_hidden_states)
            unflat = lambda t: t.reshape(*input_ids.shape, -1)  # noqa: E731
            return EncoderOutput(unflat(hidden), tuple(map(unflat, states)) if states else None)

        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        if not self._reads_device():
            # Whether the batch has padding is not looked at (that would read a device value on the host): the
            # mask is always applied, and varlen does not unpad (a data-dependent shape).
            layout = AttentionLayout.padded(attention_mask, skip_if_full=False)
            hidden, states = self._run(input_ids, position_ids, layout, output_hidden_states)
            return EncoderOutput(hidden, states)
        has_padding = attention_mask is not None and not bool(attention_mask.all())
        if self.config.attention_backend == "varlen" and has_padding:
            return self._forward_unpadded(input_ids, attention_mask, position_ids, output_hidden_states)
        layout = AttentionLayout.padded(attention_mask)
        hidden, states = self._run(input_ids, position_ids, layout, output_hidden_states)
        return EncoderOutput(hidden, states)

    def _forward_unpadded(self, input_ids, attention_mask, position_ids, output_hidden_states) -> EncoderOutput:
        keep = attention_mask.reshape(-1).bool()
        index = keep.nonzero().squeeze(1)
        lengths = attention_mask.sum(dim=1, dtype=torch.int32)
        cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        layout = AttentionLayout.from_cu_seqlens(cu_seqlens, int(lengths.max()))
        hidden, states = self._run(input_ids.reshape(-1)[index], position_ids.reshape(-1)[index], layout,
                                   output_hidden_states)

        def repad(t: Tensor) -> Tensor:
            out = t.new_zeros(input_ids.numel(), t.shape[-1])
            out[index] = t
            return out.view(*input_ids.shape, -1)

        return EncoderOutput(repad(hidden), tuple(map(repad, states)) if states else None)

    def _run(self, input_ids: Tensor, position_ids: Tensor, layout: AttentionLayout, output_hidden_states: bool):
        x = self.encoder(input_ids)
        rope = None
        if self.config.position_encoding == "rope":
            # Built once for every layer: q and k side by side, as the blocks rotate them.
            rope = RotaryTables.side_by_side(rope_tables(self.config.head_dim, position_ids, self.config.rope_theta),
                                             vectors_per_head=2)
            if self.rotation_tables_first:  # the compiled blocks' tables, so that they share one graph (compile)
                rope.interleaved(torch.float32)
        else:
            x = x + self.positional_embedding(position_ids)
        x = self.embedding_dropout(x)
        states = [x] if output_hidden_states else []
        for block in self.transformer_encoder:
            x = block(x, layout, rope)
            if output_hidden_states:
                states.append(x)
        x = self.layer_norm(x)
        if output_hidden_states:
            states[-1] = x  # as the hub code: the last state is after the final norm
        return x, tuple(states) if output_hidden_states else None

    def _check_inputs(self, input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen=None) -> None:
        config = self.config
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError(f"empty batch: input_ids has shape {tuple(input_ids.shape)}")
        # Checks of values (not shapes) read the device on the host: eager only, never inside a compiled graph.
        check_values = input_ids.device.type != "meta" and self._reads_device()
        if check_values:
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= config.vocab_size:
                raise ValueError(f"token ids must be in [0, {config.vocab_size}); got min {low}, max {high}")
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("pass either cu_seqlens (packed batch) or attention_mask (padded batch), not both")
            longest = 0  # compiled: the document lengths are not read (max_seqlen is the caller's)
        if cu_seqlens is not None and check_values:
            if int(cu_seqlens[-1]) != input_ids.numel() or int(cu_seqlens[0]) != 0:
                raise ValueError(
                    f"cu_seqlens must run from 0 to the number of tokens ({input_ids.numel()}), "
                    f"got {cu_seqlens[0]}..{cu_seqlens[-1]}"
                )
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            # Zero-length documents are allowed: a static packed batch repeats the last offset to keep one length.
            if bool((lengths < 0).any()):
                raise ValueError("cu_seqlens must not decrease (document lengths must be >= 0)")
            longest = int(lengths.max())
            if max_seqlen is not None and longest > max_seqlen:  # the kernels size their work by it
                raise ValueError(f"max_seqlen={max_seqlen} is less than the longest document's {longest} tokens "
                                 f"(cu_seqlens); pass the longest length, or None to have it read")
        elif cu_seqlens is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
            if attention_mask is not None:
                if attention_mask.shape != input_ids.shape:
                    raise ValueError(
                        f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids shape "
                        f"{tuple(input_ids.shape)}"
                    )
                if check_values and not bool(attention_mask.bool().any(dim=1).all()):
                    raise ValueError("a sequence in the batch has no real token (its attention_mask is all 0)")
            longest = input_ids.shape[1]
        if longest > config.max_length:
            raise ValueError(f"sequence length {longest} exceeds max_length={config.max_length}")
        if (check_values and position_ids is not None and position_ids.numel()
                and int(position_ids.max()) >= config.max_length):
            raise ValueError(f"position id {int(position_ids.max())} exceeds max_length={config.max_length}")


class NeoBERTForMaskedLM(NeoBERTPreTrained):
    """The hub's `NeoBERTLMHead`: encoder + an untied Linear(hidden, vocab) decoder."""

    hub_architecture = "NeoBERTLMHead"

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.config = config
        self.model = NeoBERT(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self._init_module(self.decoder)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        masked_only: bool = False,
        masked_index: Tensor | None = None,
        **encoder_kwargs,
    ) -> MaskedLMOutput:
        """labels: token ids at masked positions, -100 elsewhere. `masked_only` projects to the vocabulary
        only at the masked positions (labels != -100), which skips ~80% of the largest matmul. `masked_index`
        (flat indices of the masked positions, from the collator) does the same without finding them on the
        device: no host read, and a shape known in advance; the logits come in its order. Entries labelled -100 (the
        filler of a static packed batch's masked_index, `neobert.data.masking.StaticShapes`) count for nothing."""
        hidden = self.model(input_ids, attention_mask, **encoder_kwargs).last_hidden_state
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
            bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.config.vocab_size))
            if self._reads_device() and bool(bad.any()):
                raise ValueError(f"labels must be -100 or token ids in [0, {self.config.vocab_size})")
        if masked_index is not None:
            if labels is None:
                raise ValueError("masked_index needs labels: they are the targets at those positions")
            targets = labels.reshape(-1).index_select(0, masked_index)
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, masked_index)
            # The mean over the targets that are not -100; 0 when there are none (an empty index, or filler only).
            scored = (targets != IGNORE_INDEX).sum().clamp(min=1)
            if self._fuses_loss(rows):
                loss, predictions = liger_linear_cross_entropy(rows, self.decoder.weight, self.decoder.bias, targets,
                                                               IGNORE_INDEX)
                return MaskedLMOutput(None, loss / scored, hidden, masked_index=masked_index, predictions=predictions)
            logits, loss = self.score_masked_rows(rows, targets, scored)
            return MaskedLMOutput(logits, loss, hidden, masked_index=masked_index)
        if masked_only:
            if labels is None:
                raise ValueError("masked_only=True needs labels to know which positions are masked")
            positions = labels != IGNORE_INDEX
            rows = hidden[positions]
            if self._fuses_loss(rows):
                loss, predictions = liger_linear_cross_entropy(rows, self.decoder.weight, self.decoder.bias,
                                                               labels[positions], IGNORE_INDEX)
                return MaskedLMOutput(None, loss / rows.shape[0], hidden, positions, predictions=predictions)
            logits = self.decode(rows)
            loss = F.cross_entropy(logits.float(), labels[positions]) if logits.shape[0] else logits.sum() * 0.0
            return MaskedLMOutput(logits, loss, hidden, positions)
        logits = self.decode(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return MaskedLMOutput(logits, loss, hidden)

    def score_masked_rows(self, rows: Tensor, targets: Tensor, scored: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, loss) of the masked rows: the decoder's logits and their cross-entropy summed over the targets
        that are not -100, divided by `scored`. Eager, or compiled by `compile_masked_scoring`."""
        logits = self.decode(rows)
        return logits, F.cross_entropy(logits.float(), targets, reduction="sum") / scored

    def compile_masked_scoring(self, **kwargs) -> None:
        """`score_masked_rows` compiled (compile_scope=blocks): the loss's softmax fused into the cross-entropy, its
        float32 logits never written out whole. Dynamic in the masked rows, but under CUDA graphs (one batch shape);
        never a CUDA graph itself, whose pool the next replay would overwrite with the logits still in use."""
        mode = kwargs.pop("mode", None)
        kwargs = {"dynamic": mode not in CUDA_GRAPH_MODES, **kwargs, "mode": WITHOUT_CUDA_GRAPHS.get(mode, mode)}
        self.score_masked_rows = torch.compile(self.score_masked_rows, **kwargs)

    def __getstate__(self) -> dict:
        # The compiled scoring is bound to this model: a copy or a pickle would run the original's weights, or fail.
        # As nn.Module drops its own compiled call, the copy runs the eager method.
        state = super().__getstate__()
        state.pop("score_masked_rows", None)
        return state

    def decode(self, hidden: Tensor) -> Tensor:
        """The decoder's logits over the vocabulary (`config.decoder_pad_multiple`: its matmul on a weight padded
        with zero rows, the real columns of the result taken)."""
        return padded_linear(hidden, self.decoder.weight, self.decoder.bias, self.config.decoder_pad_multiple)

    def _fuses_loss(self, rows: Tensor) -> bool:
        """Whether the masked rows' decoder and loss run as one fused kernel (`fuses_mlm_loss`: fused_mlm_loss on a
        GPU, where a backward follows, outside a compiled graph) over at least one row (Liger's chunking divides by
        their number). Only the masked-row paths fuse: full logits are asked for to be read."""
        return rows.shape[0] > 0 and rows.requires_grad and fuses_mlm_loss(
            self.config.fused_mlm_loss, "cuda" if rows.is_cuda else rows.device.type, torch.is_grad_enabled(),
            torch.compiler.is_compiling())


class NeoBERTForSequenceClassification(ClassificationHead, NeoBERTPreTrained):
    """NeoBERT with the paper's classification head (`ClassificationHead`)."""

    hub_architecture = "NeoBERTForSequenceClassification"

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.config = config
        self.model = NeoBERT(config)
        self.add_classification_head(config.hidden_size, config.num_labels, config.classifier_dropout,
                                     config.classifier_init_range)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None, **encoder_kwargs
    ) -> SequenceClassifierOutput:
        return self.classify(self.model(input_ids, attention_mask, **encoder_kwargs).last_hidden_state, labels)


class NeoBERTForTokenClassification(TokenClassificationHead, NeoBERTPreTrained):
    """NeoBERT with a token classification head (`TokenClassificationHead`: NER, first sub-token labelling)."""

    hub_architecture = "NeoBERTForTokenClassification"

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.config = config
        self.model = NeoBERT(config)
        self.add_token_classification_head(config.hidden_size, config.num_labels, config.classifier_dropout,
                                           config.classifier_init_range)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None, **encoder_kwargs
    ) -> TokenClassifierOutput:
        return self.tag(self.model(input_ids, attention_mask, **encoder_kwargs).last_hidden_state, labels)
