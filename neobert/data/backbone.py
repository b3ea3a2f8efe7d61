"""An encoder paired with its tokenizer: any encoder behind one interface, so GLUE, contrastive training, MTEB and the benchmarks treat NeoBERT
and Hugging Face encoders (BERT, RoBERTa, ModernBERT, ...) identically.

`name_or_path` is one of:
* a directory in the NeoBERT hub layout (ours or the official), loaded with our model;
* any other local Hugging Face directory, or a hub name (`owner/name`, needs the hub), loaded with `AutoModel`;
  a path-like name that does not exist is a `ConfigError` naming the config key, never a download
  (`neobert.hub.is_hub_name` is the rule);
* `preset:<name>` (e.g. `preset:tiny`): a randomly initialised NeoBERT, for smoke runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from huggingface_hub import snapshot_download
from torch import Tensor, nn
from transformers import AutoModel

from neobert.data.tokenizer import BERT_BASE_UNCASED, load_tokenizer
from neobert.errors import ConfigError
from neobert.hub import is_hub_name, require_hub
from neobert.layout import CONFIG_NAME, has_tokenizer
from neobert.model.config import ModelFieldError, NeoBERTConfig
from neobert.model.modeling import NeoBERT

log = logging.getLogger(__name__)


def is_neobert_dir(path: str | Path) -> bool:
    config = Path(path) / CONFIG_NAME
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "neobert"


class Backbone(nn.Module):
    """forward(input_ids, attention_mask, token_type_ids=None) -> last hidden states [B, L, hidden]."""

    def __init__(self, encoder: nn.Module, tokenizer, hidden_size: int, num_layers: int, is_neobert: bool,
                 source: str | None = None):
        super().__init__()
        self.source = source  # the model directory it was loaded from (None for a preset); heads load from it
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.is_neobert = is_neobert

    @property
    def max_length(self) -> int:
        """The most tokens (special tokens included) the encoder reads: NeoBERT's `max_length`; for a Hugging Face
        encoder the smaller of its position table and its tokenizer's `model_max_length`."""
        config = self.encoder.config
        if self.is_neobert:
            return int(config.max_length)
        limits = [getattr(config, "max_position_embeddings", None), getattr(self.tokenizer, "model_max_length", None)]
        limits = [int(n) for n in limits if n is not None and 0 < n < 1_000_000]  # tokenizers say 1e30 for "no limit"
        if not limits:
            raise ValueError(f"cannot tell the maximum length of {type(self.encoder).__name__}")
        return min(limits)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """`token_type_ids` (segments of sentence pairs) reach encoders that were pretrained with them;
        NeoBERT has no segment embeddings and ignores them."""
        if self.is_neobert:
            return self.encoder(input_ids, attention_mask).last_hidden_state
        segments = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, **segments).last_hidden_state


def load_backbone(name_or_path: str, tokenizer: str | None = None, config_key: str = "model",
                  **model_overrides) -> Backbone:
    """`tokenizer` overrides where the tokenizer comes from (default: beside the weights, else bert-base-uncased
    for NeoBERT). `model_overrides` are NeoBERTConfig fields (e.g. kernels), each set by the job's config key
    `model_overrides.<field>`: a value the model cannot take is a ConfigError naming that key; other encoders ignore
    them (a warning says so where one differs from NeoBERT's default)."""
    try:
        backbone = _load_backbone(name_or_path, tokenizer, config_key, model_overrides)
    except ModelFieldError as err:
        if err.field not in model_overrides:  # a field of the checkpoint itself, not the job's
            raise
        raise err.as_config_error("model_overrides.") from err
    if not backbone.is_neobert:
        defaults = NeoBERTConfig()
        ignored = sorted(k for k, v in model_overrides.items() if v != getattr(defaults, k))
        if ignored:
            log.warning("%s: for NeoBERT models only; %s runs its own code",
                        ", ".join(f"model_overrides.{k}={model_overrides[k]}" for k in ignored), name_or_path)
    return backbone


def _load_backbone(name_or_path: str, tokenizer: str | None, config_key: str, model_overrides: dict) -> Backbone:
    tokenizer_key = "tokenizer" if tokenizer else config_key
    if name_or_path.startswith("preset:"):
        try:
            config = NeoBERTConfig.from_preset(name_or_path.removeprefix("preset:"), **model_overrides)
        except ModelFieldError:
            raise
        except ValueError as err:  # an unknown preset
            raise ConfigError(f"{config_key}={name_or_path!r}: {err}") from err
        encoder = NeoBERT(config)
        tok = load_tokenizer(tokenizer or BERT_BASE_UNCASED, max_length=config.max_length, config_key=tokenizer_key)
        return Backbone(encoder, tok, config.hidden_size, config.num_hidden_layers, True)
    path = Path(name_or_path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{config_key}={name_or_path!r} is a file; expected a model directory or a hub name")
    if not path.exists():
        check_model_name(name_or_path, config_key)
        path = Path(download_snapshot(name_or_path, config_key))
    elif not (path / CONFIG_NAME).is_file():
        raise ConfigError(f"{config_key}={name_or_path!r} is a directory without {CONFIG_NAME}: not a model directory")
    if is_neobert_dir(path):
        encoder = NeoBERT.from_pretrained(path, **model_overrides)
        tok = load_tokenizer(tokenizer or (str(path) if has_tokenizer(path) else BERT_BASE_UNCASED),
                             max_length=encoder.config.max_length, config_key=tokenizer_key)
        return Backbone(encoder, tok, encoder.config.hidden_size, encoder.config.num_hidden_layers, True, str(path))
    encoder = AutoModel.from_pretrained(str(path))
    warn_if_decoder(encoder.config, name_or_path)
    tok = load_tokenizer(tokenizer or str(path), config_key=tokenizer_key)
    cfg = encoder.config
    return Backbone(encoder, tok, cfg.hidden_size, cfg.num_hidden_layers, False, str(path))


def is_decoder(config) -> bool:
    """A causal (decoder-only) language model: its config says so, or its architecture is a causal LM head."""
    causal_heads = ("ForCausalLM", "LMHeadModel")
    architectures = getattr(config, "architectures", None) or []
    return bool(getattr(config, "is_decoder", False)) or any(
        name.endswith(causal_heads) and not name.startswith(("Bert", "Roberta", "NeoBERT")) for name in architectures)


def warn_if_decoder(config, name: str) -> None:
    """Embeddings of a decoder are pooled over causally attended tokens: GLUE/MTEB scores of it as an encoder say
    little (it used to be scored without a word)."""
    if is_decoder(config):
        log.warning("model=%r is a decoder-only (causal) model (%s): it is used as an encoder here, its tokens "
                    "attending to the left only; expect low scores unless it was adapted to bidirectional "
                    "attention", name, ", ".join(getattr(config, "architectures", None) or [config.model_type]))


def check_model_name(name_or_path: str, config_key: str = "model") -> None:
    """A model that is not on disk must be a hub name (`owner/name`): a path-like name is reported missing."""
    if not Path(name_or_path).exists() and not is_hub_name(name_or_path):
        raise ConfigError(f"{config_key}={name_or_path!r} does not exist (a local model directory was expected; "
                          f"hub models are named owner/name)")


def model_needs_hub(name_or_path: str, config_key: str = "model") -> bool:
    """Whether loading `name_or_path` downloads from the hub; a missing path-like name is a ConfigError."""
    if name_or_path.startswith("preset:") or Path(name_or_path).exists():
        return False
    check_model_name(name_or_path, config_key)
    return True


def download_snapshot(repo_id: str, config_key: str = "model") -> str:
    """Downloads a hub model's config, weights and tokenizer files; fails fast when the hub is unreachable."""
    require_hub(repo_id, config_key)
    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
