"""The offline tokenizer must be bert-base-uncased's. How we know: the packaged vocab.txt has exactly 30,522
lines and the sha256 published for bert-base-uncased's vocab.txt, and it encodes known text to the ids that
bert-base-uncased gives (special tokens at their well-known ids)."""

import pytest

from neobert.data.tokenizer import load_tokenizer, packaged_bert_vocab_dir, verify_bert_base_uncased_vocab
from neobert.hub import HubUnreachableError


def test_packaged_vocabulary_is_bert_base_uncased():
    directory = packaged_bert_vocab_dir()  # raises unless count and sha256 match
    tokenizer = load_tokenizer()
    assert len(tokenizer) == 30522
    assert tokenizer("Hello World, unaffable!")["input_ids"] == [101, 7592, 2088, 1010, 14477, 20961, 3468, 999, 102]
    assert [tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id,
            tokenizer.mask_token_id] == [0, 100, 101, 102, 103]
    assert (directory / "vocab.txt").read_text().splitlines()[1996] == "the"


def test_a_different_vocabulary_is_refused(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]"] + [f"w{i}" for i in range(30521)]) + "\n")
    with pytest.raises(RuntimeError, match="is not the bert-base-uncased vocabulary"):
        verify_bert_base_uncased_vocab(vocab)


def test_max_length_is_set_and_unknown_hub_names_fail_fast():
    assert load_tokenizer(max_length=4096).model_max_length == 4096
    with pytest.raises(HubUnreachableError, match="Set `tokenizer` to local files"):
        load_tokenizer("FacebookAI/roberta-base")
