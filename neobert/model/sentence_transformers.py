"""Export an encoder (after contrastive fine-tuning) as a sentence-transformers model: Transformer -> mean Pooling.

The directory is ALSO our hub layout (config.json with model_type "neobert" + model.safetensors + tokenizer), so
`neobert.data.backbone.load_backbone(dir)` and `SentenceTransformer(dir)` read the same weights. sentence-transformers builds the
Transformer module with `transformers.AutoModel`, which knows model_type "neobert" only after `import neobert`
(neobert/model/hf.py registers it). So that a user need not remember that import, the export also writes a
two-line `auto_map` module (`neobert_auto.py`) that re-exports our registered classes; then

    SentenceTransformer(dir, trust_remote_code=True)      # no `import neobert` needed (neobert installed)
    import neobert; SentenceTransformer(dir)               # no remote code at all

both load offline. The "remote code" is only that import of the installed package; nothing else runs.
Non-NeoBERT backbones (BERT, RoBERTa, ... via AutoModel) are saved with `save_pretrained` and need neither.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from neobert.layout import CONFIG_NAME
from neobert.model.modeling import NeoBERT

AUTO_MAP_MODULE = "neobert_auto"
_AUTO_MAP_SOURCE = '''"""Lets `transformers` (and sentence-transformers with trust_remote_code=True) load this NeoBERT export by
importing the installed `neobert` package (pip install neobert-suite); no other code is shipped here."""

from neobert.model.hf import NeoBERTHFConfig, NeoBERTHFModel  # noqa: F401
'''


def export_sentence_transformers(encoder: nn.Module, tokenizer, directory: str | Path,
                                 max_seq_length: int | None = None) -> Path:
    """`encoder`: our NeoBERT or a Hugging Face encoder (`PreTrainedModel`); `tokenizer`: its tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        raise ValueError("the encoder has no tokenizer; sentence-transformers needs one beside the weights")
    if isinstance(encoder, NeoBERT):
        encoder.save_pretrained(directory, tokenizer=tokenizer)
        _add_auto_map(directory)
        max_seq_length = max_seq_length or encoder.config.max_length
    else:
        encoder.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
        max_seq_length = max_seq_length or tokenizer.model_max_length
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    _write_json(directory / "modules.json", modules)
    _write_json(directory / "sentence_bert_config.json", {"max_seq_length": int(max_seq_length),
                                                           "do_lower_case": False})
    # Masked mean pooling, the paper's MTEB pooling (and our MTEB wrapper's); no normalisation module, so the
    # vectors are exactly our model's pooled embeddings.
    _write_json(directory / "1_Pooling" / "config.json", {
        "word_embedding_dimension": encoder.config.hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    })
    _write_json(directory / "config_sentence_transformers.json", {"similarity_fn_name": "cosine"})
    return directory


def _add_auto_map(directory: Path) -> None:
    config_path = directory / CONFIG_NAME
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoConfig": f"{AUTO_MAP_MODULE}.NeoBERTHFConfig",
                          "AutoModel": f"{AUTO_MAP_MODULE}.NeoBERTHFModel"}
    _write_json(config_path, config)
    (directory / f"{AUTO_MAP_MODULE}.py").write_text(_AUTO_MAP_SOURCE)


def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")
