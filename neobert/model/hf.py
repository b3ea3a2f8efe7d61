"""Hugging Face `transformers` classes for our checkpoints, registered with the Auto classes on import.

After `import neobert`, `AutoConfig`, `AutoModel`, `AutoModelForMaskedLM`, `AutoModelForSequenceClassification`
and `AutoModelForTokenClassification` load an exported directory (model_type "neobert") without
`trust_remote_code`. The wrappers hold our plain-PyTorch modules under the hub's names (`model`, `decoder`,
`dense`, `classifier`), so their state dicts are exactly the hub layout.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import (BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput,
                                           TokenClassifierOutput)

from neobert.model.config import MACHINE_FIELDS, NeoBERTConfig
from neobert.model.heads import ClassificationHead, TokenClassificationHead
from neobert.model.modeling import NeoBERT, NeoBERTForMaskedLM, NeoBERTPreTrained

_FIELDS = {f.name: f.default for f in dataclasses.fields(NeoBERTConfig)}


class NeoBERTHFConfig(PretrainedConfig):
    model_type = "neobert"

    def __init__(self, **kwargs):
        # Our fields, with the official defaults where the hub file omits them (as NeoBERTConfig.from_hub_dict).
        kwargs.pop("dim_head", None)
        values = {name: kwargs.pop(name, default) for name, default in _FIELDS.items()}
        # PretrainedConfig owns num_labels (via id2label); a file with num_labels but no id2label keeps its count.
        num_labels = values.pop("num_labels")
        if "id2label" not in kwargs:
            kwargs["num_labels"] = num_labels
        super().__init__(pad_token_id=values.pop("pad_token_id"), **kwargs)
        for name, value in values.items():
            setattr(self, name, value)
        self.dim_head = self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        # The machine's choices stay out of config.json, as NeoBERTConfig.to_hub_dict leaves them out: whoever loads
        # the checkpoint picks the kernels of their own machine (from_pretrained(..., attention_kernel=...)).
        return {name: value for name, value in super().to_dict().items() if name not in MACHINE_FIELDS}

    def _get_generation_parameters(self) -> dict:
        # The hub's `max_length` is the encoder's context length, not a text-generation setting.
        return {}

    def to_neobert_config(self) -> NeoBERTConfig:
        values = {name: getattr(self, name) for name in _FIELDS if name not in ("pad_token_id", "num_labels")}
        return NeoBERTConfig(pad_token_id=self.pad_token_id, num_labels=self.num_labels, **values)


class NeoBERTHFPreTrainedModel(PreTrainedModel):
    config_class = NeoBERTHFConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    # Each loss is the mean over its own batch and takes no num_items_in_batch: transformers' Trainer then divides it
    # by the gradient accumulation steps itself, instead of passing a count the forward would ignore.
    accepts_loss_kwargs = False

    def _init_weights(self, module: nn.Module) -> None:
        if module is getattr(self, "dense", None) or module is getattr(self, "classifier", None):
            nn.init.normal_(module.weight, std=self.config.classifier_init_range)
            nn.init.zeros_(module.bias)
        else:
            NeoBERTPreTrained._init_module(self, module)  # reads self.config.{decoder,embedding}_init_range

    def get_input_embeddings(self) -> nn.Module:
        return self.model.encoder


class NeoBERTHFModel(NeoBERTHFPreTrainedModel):
    """AutoModel: returns `last_hidden_state` (after the final norm). token_type_ids are accepted and ignored."""

    def __init__(self, config: NeoBERTHFConfig):
        super().__init__(config)
        self.model = NeoBERT(config.to_neobert_config())
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        out = self.model(input_ids, attention_mask, position_ids, output_hidden_states=bool(output_hidden_states))
        return BaseModelOutput(last_hidden_state=out.last_hidden_state, hidden_states=out.hidden_states)


class NeoBERTHFForMaskedLM(NeoBERTHFPreTrainedModel):
    def __init__(self, config: NeoBERTHFConfig):
        super().__init__(config)
        neo = config.to_neobert_config()
        self.model = NeoBERT(neo)
        self.decoder = nn.Linear(neo.hidden_size, neo.vocab_size)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.decoder

    decode = NeoBERTForMaskedLM.decode  # reads self.decoder and self.config.decoder_pad_multiple, both here too

    def _reads_device(self) -> bool:
        """Whether the forward checks the labels' values: as the encoder checks its inputs (`validate_inputs`)."""
        return self.model._reads_device()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        # Same attribute names as our module, so its forward runs unchanged on this wrapper.
        out = NeoBERTForMaskedLM.forward(self, input_ids, attention_mask, labels=labels, position_ids=position_ids)
        return MaskedLMOutput(loss=out.loss, logits=out.logits)


class NeoBERTHFForSequenceClassification(ClassificationHead, NeoBERTHFPreTrainedModel):
    def __init__(self, config: NeoBERTHFConfig):
        super().__init__(config)
        neo = config.to_neobert_config()
        self.model = NeoBERT(neo)
        self.add_classification_head(neo.hidden_size, neo.num_labels, neo.classifier_dropout,
                                     neo.classifier_init_range)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        hidden = self.model(input_ids, attention_mask, position_ids).last_hidden_state
        out = self.classify(hidden, labels)
        return SequenceClassifierOutput(loss=out.loss, logits=out.logits)


class NeoBERTHFForTokenClassification(TokenClassificationHead, NeoBERTHFPreTrainedModel):
    def __init__(self, config: NeoBERTHFConfig):
        super().__init__(config)
        neo = config.to_neobert_config()
        self.model = NeoBERT(neo)
        self.add_token_classification_head(neo.hidden_size, neo.num_labels, neo.classifier_dropout,
                                           neo.classifier_init_range)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        hidden = self.model(input_ids, attention_mask, position_ids).last_hidden_state
        out = self.tag(hidden, labels)
        return TokenClassifierOutput(loss=out.loss, logits=out.logits)


def register() -> None:
    AutoConfig.register("neobert", NeoBERTHFConfig, exist_ok=True)
    AutoModel.register(NeoBERTHFConfig, NeoBERTHFModel, exist_ok=True)
    AutoModelForMaskedLM.register(NeoBERTHFConfig, NeoBERTHFForMaskedLM, exist_ok=True)
    AutoModelForSequenceClassification.register(NeoBERTHFConfig, NeoBERTHFForSequenceClassification, exist_ok=True)
    AutoModelForTokenClassification.register(NeoBERTHFConfig, NeoBERTHFForTokenClassification, exist_ok=True)
