"""The NeoBERT architecture in plain PyTorch (no Lightning)."""

from neobert.model.checkpoint import load_state_dict_strict
from neobert.model.config import PRESETS, NeoBERTConfig
from neobert.model.heads import SequenceClassifierOutput, TokenClassifierOutput, pool_embeddings
from neobert.model.modeling import (
    EncoderOutput,
    MaskedLMOutput,
    NeoBERT,
    NeoBERTForMaskedLM,
    NeoBERTForSequenceClassification,
    NeoBERTForTokenClassification,
)
from neobert.model.official import convert_official_state_dict

__all__ = [
    "PRESETS", "NeoBERTConfig", "NeoBERT", "NeoBERTForMaskedLM", "NeoBERTForSequenceClassification",
    "NeoBERTForTokenClassification", "TokenClassifierOutput",
    "EncoderOutput", "MaskedLMOutput", "SequenceClassifierOutput", "pool_embeddings",
    "convert_official_state_dict", "load_state_dict_strict",
]
