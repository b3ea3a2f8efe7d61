"""NeoBERT experiment suite: model, data, Lightning modules and evaluation."""

from neobert.model import (  # noqa: F401
    NeoBERT,
    NeoBERTConfig,
    NeoBERTForMaskedLM,
    NeoBERTForSequenceClassification,
    pool_embeddings,
)
from neobert.model.hf import register as _register_with_transformers

_register_with_transformers()

__version__ = "0.1.0"
