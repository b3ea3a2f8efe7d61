"""The encoders under test of the throughput measurement (paper Figure 3 and Table 9) and their batches.

* encoders: our NeoBERT and the Hugging Face implementations of BERT-base, RoBERTa-base and ModernBERT-base
  (random init from their config classes, nothing downloaded), plus the official NeoBERT hub code when it can be
  imported (`build_model`, `BenchModel`); ours also with Liger's kernels (``neobert-liger``) and with each attention
  kernel of `NeoBERTConfig.attention_kernel` (``neobert-<kernel>``: full rows as one document each, and unpadded
  documents, through that kernel; padded batches run SDPA whatever the choice), each NeoBERT row's note naming the
  kernel its layout ran;
* layouts: ``full`` (every sequence exactly `length` tokens), ``padded`` (a realistic spread of document
  lengths padded to `length`) and ``unpadded`` (the same documents with no pad tokens: our packed varlen path;
  ModernBERT's flash-attention unpadding on GPU only). Only real tokens count towards tokens/s (`make_batch`);
* FLOPs/token come from :mod:`neobert.eval.flops` for every model, giving achieved FLOP/s (and MFU on GPU).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from huggingface_hub import snapshot_download
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, BertConfig, ModernBertConfig, RobertaConfig

from neobert.config.throughput import ATTENTION_KERNEL_MODELS, KERNEL_MODELS, LAYOUTS, WINDOWED_MODELS
from neobert.eval.flops import attention_flops, flops_per_token, matmul_params
from neobert.model import NeoBERT, NeoBERTConfig
from neobert.model.attention import (attention_kernel_missing_reason, chosen_packed_kernel, cu_seqlens_of_rows,
                                     flash_attn_packages)
from neobert.model.kernels import liger_missing_reason, quack_missing_reason, quack_takes

OFFICIAL_HUB_NAME = "chandar-lab/NeoBERT"


# ---------------------------------------------------------------------------------------------- models
@dataclass
class BenchModel:
    """One encoder under test. `run(batch)` performs one forward (or training) step on a prepared batch."""

    name: str
    module: nn.Module
    num_layers: int
    hidden_size: int
    max_length: int
    vocab_size: int
    pad_token_id: int
    forward: Callable[[nn.Module, "Batch"], Tensor]
    attention: dict[str, str] = field(default_factory=dict)  # layout -> the attention kernel it runs (a note)
    skipped_layouts: dict[str, str] = field(default_factory=dict)  # layout -> why it is not timed for this model
    cuda_graphs: bool = False  # compiled into CUDA graphs (reduce-overhead): each call a new step of them
    # `time_step`'s last step: the seconds the host took to issue it, from its start to the final wait for the device
    issued_s: float = 0.0

    @property
    def matmul_weights(self) -> int:
        return matmul_params(self.module)

    def flops_per_token(self, seq_len: int, training: bool) -> float:
        """Per token of a sequence of `seq_len` tokens."""
        return flops_per_token(self.matmul_weights, self.num_layers, self.hidden_size, seq_len, training)

    def batch_flops_per_token(self, batch: "Batch", training: bool) -> float:
        """Per real token of `batch`, its attention counted over its documents' real lengths (padding computes
        nothing useful; a document attends over itself only)."""
        attention = attention_flops(self.num_layers, self.hidden_size, batch.squared_lengths, training)
        return self.flops_per_token(0, training) + attention / batch.real_tokens


# Hugging Face encoders without FlashAttention 2, and the official code: no packed (cu_seqlens) forward
NO_UNPADDED_PATH = {"unpadded": "no unpadded path on this machine"}


class ModelUnavailable(RuntimeError):
    """The model cannot be built on this machine (e.g. the official code cannot be imported)."""


def neobert_forward(module: nn.Module, batch: "Batch") -> Tensor:
    """One forward of our encoder on a benchmark batch (packed varlen when it has cu_seqlens): the throughput
    benchmark's and the GPU check's model-alone step."""
    if batch.cu_seqlens is not None:  # our packed varlen path: pad tokens are never computed
        return module(batch.input_ids, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen).last_hidden_state
    return module(batch.input_ids, batch.attention_mask).last_hidden_state


def neobert_documents_forward(module: nn.Module, batch: "Batch") -> Tensor:
    """`neobert_forward` with full rows (no padding) given as one document each (cu_seqlens), so that a full batch
    runs the packed kernel of `NeoBERTConfig.attention_kernel` too, as a packed pretraining batch does."""
    if batch.cu_seqlens is None and batch.attention_mask is None:
        batch = rows_as_documents(batch)
    return neobert_forward(module, batch)


def _hf_forward(module: nn.Module, batch: "Batch") -> Tensor:
    if batch.cu_seqlens is not None:
        # transformers' packed form (flash_attention_2 only): one row of documents, positions restart per doc.
        return module(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]).last_hidden_state
    return module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state


def _hf_config(name: str):
    if name == "bert-base":
        return BertConfig()  # the defaults are bert-base-uncased: 12 x 768, 30,522 tokens, 512 positions
    if name == "roberta-base":
        return RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                             bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)
    return ModernBertConfig()  # the defaults are ModernBERT-base: 22 x 768, 8,192 positions


def graphs_per_shape(name: str) -> int:
    """Graphs a row compiles per shape (an estimate): 1, but once per layer for transformers' FA4 rows, whose
    attention breaks the graph and whose resumed frame dynamo guards on `module.layer_idx`."""
    return _hf_config(name).num_hidden_layers if WINDOWED_MODELS.get(name) == "flash_attention_4" else 1


def _hf_max_length(name: str, config) -> int:
    # RoBERTa's positions start after the padding index: 514 embeddings hold 512 tokens.
    return config.max_position_embeddings - (2 if name == "roberta-base" else 0)


def build_model(name: str, device: torch.device, dtype: torch.dtype, neobert_preset: str = "neobert",
                official_code_dir: str | None = None, compute_dtype: torch.dtype | None = None,
                training: bool = False, model_overrides: dict[str, Any] | None = None,
                compiled: bool = False) -> BenchModel:
    """A randomly initialised encoder (no download), its weights in `dtype`. `compute_dtype` (the autocast dtype of a
    training step; default `dtype`) and `training` (dropout on) decide which attention kernel a NeoBERT runs, and with
    `compiled` (it will be compiled) whether its kernels choice can run; `model_overrides` are NeoBERTConfig fields
    of every NeoBERT row (the row's own kernel choice wins). Raises ModelUnavailable with the reason when it cannot be
    built or its kernels cannot run here."""
    if name in ("neobert",) + KERNEL_MODELS + ATTENTION_KERNEL_MODELS:
        bench = _build_neobert(name, device, compute_dtype or dtype, training, neobert_preset,
                               dict(model_overrides or {}), compiled)
    elif name == "neobert-official":
        bench = _build_official(official_code_dir)
    else:
        config = _hf_config(name)
        attn = hf_attention(name, device)
        if attn == "flex_attention" and training and device.type != "cuda":
            raise ModelUnavailable("FlexAttention has no backward on a CPU (its training rows run on a GPU)")
        if attn == "flash_attention_4":
            unavailable = attention_kernel_missing_reason("flash_attn_4") or (
                None if device.type == "cuda" else "FlashAttention 4 runs on CUDA GPUs only (Hopper, Blackwell)")
            if unavailable:
                raise ModelUnavailable(unavailable)
        module = AutoModel.from_config(config, attn_implementation=attn)
        skipped = dict(NO_UNPADDED_PATH)
        if attn == "flash_attention_2":
            skipped = {}
        elif attn == "flash_attention_4":  # transformers' packed form (position_ids) through FA4: not tried here
            skipped = {"unpadded": "the packed form is timed with flash_attention_2 only"}
        bench = BenchModel(name, module, config.num_hidden_layers, config.hidden_size, _hf_max_length(name, config),
                           config.vocab_size, config.pad_token_id, _hf_forward,
                           attention={layout: f"attention: {attn}" + WINDOW_NOTE * windowed(name, attn)
                                      for layout in LAYOUTS},
                           skipped_layouts=skipped)
    bench.module.to(device=device, dtype=dtype)
    return bench


def _build_neobert(name: str, device: torch.device, compute_dtype: torch.dtype, training: bool, preset: str,
                   overrides: dict[str, Any], compiled: bool) -> BenchModel:
    """neobert (auto attention kernel, eager norms and MLP, unless `overrides` say otherwise), neobert-liger,
    neobert-quack or neobert-<attention kernel>, each with `overrides` but for its own choice; unavailable, saying
    why, where a kernel it names would not run (a row would time another one under its name)."""
    kernels, attention_kernel = overrides.pop("kernels", "eager"), overrides.pop("attention_kernel", "auto")
    if name in KERNEL_MODELS:
        kernels = name.removeprefix("neobert-")
    elif name != "neobert":
        attention_kernel = name.removeprefix("neobert-")
    if attention_kernel != "auto":
        unavailable = attention_kernel_missing_reason(attention_kernel)
        if unavailable is None and device.type != "cuda" and attention_kernel != "padded_sdpa":
            # elsewhere every choice runs padded_sdpa
            unavailable = f"attention_kernel={attention_kernel} runs on CUDA GPUs only"
        if unavailable:
            raise ModelUnavailable(unavailable)
    config = NeoBERTConfig.from_preset(preset, attention_kernel=attention_kernel, **overrides)
    if unavailable := _kernels_unavailable(kernels, config, device, compute_dtype, compiled):
        raise ModelUnavailable(unavailable)
    config = dataclasses.replace(config, kernels=kernels)
    try:
        packed = chosen_packed_kernel(attention_kernel, device.type, compute_dtype,
                                      config.dropout if training else 0.0,
                                      config.head_dim, training)
    except ValueError as err:  # the kernel does not take this dtype or dropout
        raise ModelUnavailable(str(err)) from err
    skipped = {}
    if attention_kernel == "auto":
        attention = {"full": "attention: sdpa (no mask)", "padded": "attention: sdpa (key-padding mask)"}
        forward = neobert_forward
    else:  # full rows go through the chosen kernel as one document each; a padded batch would time SDPA instead
        attention = {"full": f"attention: {packed} (rows as documents, cu_seqlens)"}
        skipped["padded"] = (f"padded batches run SDPA with a key-padding mask whatever attention_kernel; the "
                             f"unpadded layout times {attention_kernel} on the same documents")
        forward = neobert_documents_forward
    attention["unpadded"] = f"attention: {packed}"
    # what neither the row's name nor its attention note says
    unnamed = {"kernels": kernels} if kernels != "eager" and name not in KERNEL_MODELS else {}
    if unnamed or overrides:
        chosen = ", ".join(f"{key}={value}" for key, value in {**unnamed, **overrides}.items())
        attention = {layout: f"{note}; {chosen}" for layout, note in attention.items()}
    return BenchModel(name, NeoBERT(config), config.num_hidden_layers, config.hidden_size, config.max_length,
                      config.vocab_size, config.pad_token_id, forward, attention, skipped)


def _kernels_unavailable(kernels: str, config: NeoBERTConfig, device: torch.device, compute_dtype: torch.dtype,
                         compiled: bool) -> str | None:
    """Why NeoBERTConfig.kernels=`kernels` would not run in this row (its package, the device, a compiled model, its
    computation's dtype, the MLP), or None."""
    if kernels == "eager":
        return None
    missing = liger_missing_reason() if kernels == "liger" else quack_missing_reason()
    if missing or device.type != "cuda":
        return missing or f"kernels={kernels} runs on CUDA GPUs only"
    if kernels == "liger" and compiled:
        return "kernels=liger runs eager models only: compiled, the model runs Inductor's kernels"
    if kernels == "quack" and not (config.activation == "swiglu"
                                   and quack_takes(compute_dtype, (config.hidden_size, config.ffn_hidden_size))):
        return (f"kernels=quack takes a SwiGLU MLP of widths multiples of 8 computed in bf16 or fp16 on a GPU of "
                f"compute capability 8.0 or later; here ({config.activation}, {compute_dtype}) it would run eager")
    return None


# The FLOP count is a dense encoder's: a windowed row's local layers skip most of their attention, so its MFU and
# per-FLOP ratios overstate (tokens/s is what Figure 3 compares).
WINDOW_NOTE = " (FLOPs counted dense; the sliding window's skipped blocks are not computed)"


def windowed(name: str, attention: str) -> bool:
    """Whether a Hugging Face row's attention skips the blocks outside ModernBERT's sliding window: its own
    FlexAttention and FlashAttention 4 rows, and modernbert-base on flash_attention_2 (transformers passes ModernBERT's
    window to FlashAttention there; SDPA computes the whole attention and masks it)."""
    return name in WINDOWED_MODELS or (name.startswith("modernbert") and attention == "flash_attention_2")


def hf_attention(name: str, device: torch.device) -> str:
    """The attention implementation a Hugging Face row runs: SDPA; ModernBERT's unpadding path (flash_attention_2)
    where flash-attn 2 is installed on a GPU; a WINDOWED_MODELS row's own (FlexAttention, FlashAttention 4)."""
    if name in WINDOWED_MODELS:
        return WINDOWED_MODELS[name]
    if device.type == "cuda" and name == "modernbert-base" and flash_attn_packages()[0]:
        return "flash_attention_2"
    return "sdpa"


def _build_official(code_dir: str | None) -> BenchModel:
    """The hub's own modeling file (trust_remote_code), from `official_code_dir` or the local hub cache."""
    if code_dir is None:
        try:
            code_dir = snapshot_download(OFFICIAL_HUB_NAME, local_files_only=True, allow_patterns=["*.py", "*.json"])
        except Exception as err:  # not in the local cache; downloading is not this benchmark's job
            raise ModelUnavailable(
                f"the official code ({OFFICIAL_HUB_NAME}) is not in the local hub cache; set official_code_dir "
                f"to a copy of the hub repository ({type(err).__name__})"
            ) from err
    if not (Path(code_dir) / "model.py").is_file():
        raise ModelUnavailable(f"official_code_dir={code_dir!r} has no model.py (the hub modeling file)")
    try:
        config = AutoConfig.from_pretrained(code_dir, trust_remote_code=True)
        module = AutoModel.from_config(config, trust_remote_code=True)
    except Exception as err:  # e.g. its hard xFormers import on a CPU machine
        raise ModelUnavailable(f"the official modeling code cannot be imported: {type(err).__name__}: {err}") from err
    return BenchModel("neobert-official", module, config.num_hidden_layers, config.hidden_size, config.max_length,
                      config.vocab_size, config.pad_token_id, _hf_forward, skipped_layouts=dict(NO_UNPADDED_PATH))


# ---------------------------------------------------------------------------------------------- batches
@dataclass
class Batch:
    input_ids: Tensor  # [B, L] padded, or [T] packed
    attention_mask: Tensor | None
    real_tokens: int
    squared_lengths: int  # sum of its documents' squared real lengths: their attention's work
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None
    position_ids: Tensor | None = None


def rows_as_documents(batch: Batch) -> Batch:
    """A full batch ([B, L], no padding) laid end to end, one document per row (cu_seqlens): the packed layout of the
    same tokens."""
    rows, length = batch.input_ids.shape
    cu_seqlens = cu_seqlens_of_rows(rows, length, batch.input_ids.device)
    return Batch(batch.input_ids.reshape(-1), None, batch.real_tokens, batch.squared_lengths, cu_seqlens, length)


def document_lengths(batch_size: int, length: int, generator: torch.Generator,
                     distribution: str = "uniform") -> list[int]:
    """Document lengths for padded and unpadded batches, at most `length`:
    * uniform: uniform in [length/8, length], with one document of the full length so that the padded width is
      `length` (as a length-sorted loader would give);
    * lognormal: median length/4, sigma 0.7 (a long right tail, as real text has; ~3% reach the cap), at least 8
      tokens; the padded width is the longest document of the batch."""
    if distribution == "lognormal":
        draws = torch.randn(batch_size, generator=generator, dtype=torch.float64) * 0.7 + math.log(length / 4)
        return draws.exp().round().clamp(min(8, length), length).long().tolist()
    low = max(1, length // 8)
    lengths = torch.randint(low, length + 1, (batch_size,), generator=generator).tolist()
    lengths[0] = length
    return lengths


def make_batch(batch_size: int, length: int, layout: str, vocab_size: int, pad_token_id: int,
               device: torch.device, seed: int = 0, distribution: str = "uniform") -> Batch:
    generator = torch.Generator().manual_seed(seed)
    if layout == "full":
        lengths = [length] * batch_size
    else:
        lengths = document_lengths(batch_size, length, generator, distribution)
        length = max(lengths)  # padded to the batch's longest document
    ids = torch.randint(0, vocab_size, (batch_size, length), generator=generator)
    ids[ids == pad_token_id] = (pad_token_id + 1) % vocab_size  # pad ids only where padding is
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    real, squared = int(mask.sum()), sum(n * n for n in lengths)
    if layout == "unpadded":
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        positions = torch.cat([torch.arange(n) for n in lengths])
        return Batch(ids[mask.bool()].to(device), None, real, squared, cu.to(device), max(lengths),
                     positions.to(device))
    ids = ids.masked_fill(mask == 0, pad_token_id)
    return Batch(ids.to(device), mask.to(device) if layout == "padded" else None, real, squared)
