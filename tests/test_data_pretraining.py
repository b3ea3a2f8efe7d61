"""The pretraining data pipeline: sources, config errors, packing without cross-document attention or
inner [PAD], stream resume, no duplication across streams, length buckets, skipped documents, pre-tokenized
shards."""

import itertools
import json
import random

import pytest
import torch

from neobert.config import ConfigError
from neobert.config.pretrain import MaskingConfig, PretrainDataConfig
from neobert.data import pretraining
from neobert.data.corpus import DocumentTokenizer, open_source, pretokenize, text_column, unigram_entropy
from neobert.data.demo_corpus import demo_documents
from neobert.data.pretraining import PretrainingDataModule, PretrainingStream
from neobert.data.stream_state import DATA_STATE_KEY, SourcePosition, batch_stream_state, derived_seed
from neobert.data.tokenizer import load_tokenizer
from neobert.hub import HubUnreachableError
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with path.open("w") as f:
        for doc in demo_documents()[:300]:
            f.write(json.dumps(doc) + "\n")
    return path


def _data(corpus, **kw):
    values = dict(source=str(corpus), max_length=64, shuffle_buffer=50, num_workers=0)
    values.update(kw)
    return PretrainDataConfig(**values)


def _take(stream, n):
    return list(itertools.islice(iter(stream), n))


def document_ids(batch: dict) -> list[int]:
    """The token ids of a batch of one document: unpadded (data.unpad, the default) or padded."""
    ids = batch["input_ids"][0]
    return (ids[batch["attention_mask"][0].bool()] if "attention_mask" in batch else ids).tolist()


def test_missing_local_source_and_unreachable_hub_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.source"):
        PretrainingDataModule(_data(tmp_path / "nothing.jsonl"), MaskingConfig(), None, 2).check_source()
    with pytest.raises(ConfigError, match="matches no files"):
        PretrainingDataModule(_data(str(tmp_path / "*.parquet")), MaskingConfig(), None, 2).check_source()
    with pytest.raises(HubUnreachableError, match="data.source"):  # HF_HUB_OFFLINE=1 in conftest
        PretrainingDataModule(PretrainDataConfig(), MaskingConfig(), None, 2).check_source()


def test_wrong_text_column_is_named(corpus, tokenizer):
    stream = PretrainingStream(_data(corpus, text_column="text"), MaskingConfig(), tokenizer, 2)
    with pytest.raises(ConfigError, match="data.text_column='text'"):
        _take(stream, 1)


def test_stream_resumes_exactly_from_any_batch(corpus, tokenizer):
    for packing in ("none", "greedy"):
        data = _data(corpus, packing=packing)
        straight = _take(PretrainingStream(data, MaskingConfig(), tokenizer, 4), 85)  # crosses blocks (and an epoch)
        for k in (2, 25, 79):
            state = batch_stream_state(straight[k])
            resumed = _take(PretrainingStream(data, MaskingConfig(), tokenizer, 4, start_states={0: state}), 5)
            for a, b in zip(straight[k + 1 :], resumed):
                assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
        assert straight[-1][DATA_STATE_KEY]["state"].epoch == (0 if packing == "greedy" else 1)


def test_streams_split_documents_without_duplication(corpus, tokenizer):
    data = _data(corpus, num_workers=2, max_length=512, shuffle_buffer=1)
    seen = []
    for rank in range(2):
        for worker in range(2):  # stream ids rank * workers + worker
            stream = PretrainingStream(data, MaskingConfig(), tokenizer, 1, rank=rank, world_size=2, rotation=worker)
            docs = []
            for batch in _take(stream, 300):
                if batch[DATA_STATE_KEY]["state"].epoch > 0:
                    break
                docs.append(tuple(document_ids(batch)))
            seen.append(docs)
    assert sum(map(len, seen)) == 300, [len(s) for s in seen]  # every document once, with 4 streams
    assert len(set(itertools.chain(*seen))) == len(set(itertools.chain(*seen)))
    assert all(not set(a) & set(b) for a, b in itertools.combinations(seen, 2))


def test_packing_has_no_inner_pad_and_no_cross_document_attention(corpus, tokenizer):
    data = _data(corpus, packing="greedy", max_length=48)
    batch = _take(PretrainingStream(data, MaskingConfig(rate=0.15), tokenizer, 3), 2)[1]
    assert (batch["input_ids"] != tokenizer.pad_token_id).all()
    cu = batch["cu_seqlens"]
    assert cu[-1] == batch["input_ids"].numel() and len(cu) > 4  # several documents in 3 rows

    torch.manual_seed(0)
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", vocab_size=len(tokenizer), max_length=64)).eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], cu_seqlens=cu, max_seqlen=batch["max_seqlen"]).logits.reshape(-1, len(tokenizer))
        flat = batch["input_ids"].reshape(-1)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(flat[start:end][None]).logits[0]
            torch.testing.assert_close(packed[start:end], alone, atol=1e-5, rtol=1e-4)


def test_length_buckets_follow_the_probabilities(corpus, tokenizer):
    def lengths(probabilities, n=150):
        data = _data(corpus, max_length=512, length_buckets=[0, 125], bucket_probabilities=probabilities)
        return [len(document_ids(b)) for b in _take(PretrainingStream(data, MaskingConfig(), tokenizer, 1), n)]

    plain = [len(document_ids(b)) for b in _take(PretrainingStream(_data(corpus, max_length=512), MaskingConfig(), tokenizer, 1), 150)]
    assert lengths([1.0, 0.0]) == plain  # bucket ">= 0" is the stream itself
    assert min(lengths([0.0, 1.0], 30)) >= 125  # bucket ">= 125" only long documents
    natural = sum(n >= 125 for n in plain) / len(plain)
    mixed = sum(n >= 125 for n in lengths([0.5, 0.5], 300)) / 300
    assert 0.05 < natural < 0.9 and mixed > natural + 0.1, (natural, mixed)


def test_empty_and_undecodable_documents_are_skipped(tmp_path, tokenizer):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"First real paragraph about parsers.\n\n   \n\nBroken \xff\xfe bytes here.\n\n"
                     b"Second real paragraph about lexers.\n")
    data = _data(path, shuffle_buffer=1)
    assert text_column(data) == "text"
    batches = _take(PretrainingStream(data, MaskingConfig(), tokenizer, 1), 2)
    decoded = [tokenizer.decode(b["labels"][0].where(b["labels"][0] != -100, b["input_ids"][0])) for b in batches]
    assert "parsers" in decoded[0] and "lexers" in decoded[1]
    assert batch_stream_state(batches[-1])["skipped"]["undecodable"] == 1


def test_pretokenized_shards_give_the_same_batches(corpus, tokenizer, tmp_path):
    data = _data(corpus)
    pretokenize(data, tokenizer, tmp_path / "tok", docs_per_shard=120)
    assert len(list((tmp_path / "tok").glob("*.parquet"))) == 3
    raw = _take(PretrainingStream(data, MaskingConfig(), tokenizer, 4), 10)
    tok = _take(PretrainingStream(_data(corpus, pretokenized_dir=str(tmp_path / "tok")), MaskingConfig(), tokenizer, 4), 10)
    for a, b in zip(raw, tok):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_unigram_entropy_is_positive_and_below_uniform(corpus, tokenizer):
    entropy = unigram_entropy(_data(corpus), tokenizer)
    assert 3.0 < entropy < torch.log(torch.tensor(float(len(tokenizer)))).item()
    assert open_source(_data(corpus)) is not None


def test_data_pipeline_benchmark_measures_all_three_pipelines():
    from neobert.instruments.data_pipeline import measure_data_pipeline

    results = measure_data_pipeline(docs=60, max_length=64, batch_size=8, repeats=1)
    rates = [results[k] for k in ("hf_collator_tokens_per_s", "ours_truncate_tokens_per_s", "ours_pack_tokens_per_s")]
    assert all(rate > 0 for rate in rates)
    assert results["ratio_pack_vs_hf"] == pytest.approx(rates[2] / rates[0])


def test_a_block_is_tokenized_as_the_stream_needs_it_in_the_block_shuffled_order(corpus, tokenizer, monkeypatch):
    # The first document of a block used to wait for the whole block (data.shuffle_buffer documents, 10,000 in the
    # paper's config) to be tokenized: a worker stall at every block start. Now it waits for one chunk, and the
    # documents are those, in that order, of the whole block shuffled: the block's permutation of its raw documents.
    monkeypatch.setattr(pretraining, "TOKENIZE_CHUNK", 16)
    data = _data(corpus, shuffle_buffer=200)
    stream = PretrainingStream(data, MaskingConfig(), tokenizer, 4)
    encoded = []
    encode = stream.tokenizers[0].encode
    monkeypatch.setattr(stream.tokenizers[0], "encode", lambda documents: encoded.append(len(documents)) or encode(documents))
    documents = stream.documents(0, SourcePosition())
    first = [next(documents) for _ in range(20)]
    assert encoded == [16, 16]  # two chunks for 20 documents, not the block's 200

    texts = [doc["content"] for doc in demo_documents()[:200]]
    order = list(range(200))
    random.Random(derived_seed(data.seed, 0, 0, 0)).shuffle(order)
    whole_block = DocumentTokenizer(tokenizer, "content")({"content": texts}, {})  # the block at once, as before
    assert first == [whole_block[i] for i in order[:20]]


def test_the_stream_benchmark_reads_every_stream_and_sizes_its_checkpointed_position(corpus, capsys):
    from experiments.bench_data import main

    results = main(["--stream", str(corpus), "--streams", "4", "--docs", "64", "--batch-size", "8",
                    "--max-length", "64"])
    assert results["streams_with_a_position"] == 4  # 1 + 8 batches, every stream in turn
    assert results["documents_per_s"] > 0 and results["ms_per_batch"] > 0 and results["data_state_bytes"] > 4 * 100  # a position per stream
    assert "one reader of data.streams=4 (none, 8 x 64)" in capsys.readouterr().out
