"""Training with data.packing=none (the paper's truncation, one document per sequence) runs unpadded by default
(data.unpad): the batch's documents laid end to end with cu_seqlens, so no [PAD] goes through a matmul and varlen
(FlashAttention) kernels apply. It must be the padded batch with its [PAD] removed: the same documents, masks, loss and
gradients. And xFormers' block-diagonal mask is built once per forward, not once per layer (a host read each)."""

from __future__ import annotations

import json
import sys
import types

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from test_host_syncs import HostReads
from test_pretrain import tiny_config

from neobert.config.pretrain import MaskingConfig, PretrainDataConfig
from neobert.data.demo_corpus import demo_documents
from neobert.data.masking import IGNORE_INDEX, MLMMasker
from neobert.data.pretraining import DATA_STATE_KEY, PretrainingStream
from neobert.data.tokenizer import load_tokenizer
from neobert.jobs.pretrain import build_model_config, run_pretraining
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model import attention


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _docs(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [[101] + torch.randint(1000, 30000, (n - 2,), generator=generator).tolist() + [102] for n in lengths]


LENGTHS = [37, 5, 64, 18, 9, 50]  # padded to 64: 182 real tokens of 384 slots


@pytest.mark.parametrize("strategy", ["all_mask", "bert"])
def test_the_unpadded_batch_is_the_padded_batch_without_its_pad(tokenizer, strategy):
    masker = MLMMasker.from_tokenizer(tokenizer, rate=0.3, strategy=strategy)
    docs = _docs(LENGTHS)
    padded = masker.collate_padded(docs, torch.Generator().manual_seed(3))
    unpadded = masker.collate_unpadded(docs, torch.Generator().manual_seed(3))
    keep = padded["attention_mask"].bool()
    assert "attention_mask" not in unpadded and unpadded["input_ids"].shape == (1, sum(LENGTHS))
    assert (unpadded["input_ids"] != tokenizer.pad_token_id).all()
    assert torch.equal(unpadded["input_ids"][0], padded["input_ids"][keep])  # same documents, same masked inputs
    assert torch.equal(unpadded["labels"][0], padded["labels"][keep])  # same masked positions and targets
    assert (padded["labels"][~keep] == IGNORE_INDEX).all()
    assert unpadded["cu_seqlens"].dtype == torch.int32
    assert unpadded["cu_seqlens"].tolist() == [0, 37, 42, 106, 124, 133, 183]
    assert unpadded["max_seqlen"] == 64
    flat_labels = unpadded["labels"].reshape(-1)
    assert torch.equal(flat_labels[unpadded["masked_index"]], padded["labels"].reshape(-1)[padded["masked_index"]])


@pytest.mark.parametrize("masked", ["index", "full_logits"])
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_loss_and_gradients_of_padded_and_unpadded_batches_are_equal(tokenizer, masked, backend):
    torch.manual_seed(0)
    config = NeoBERTConfig.from_preset("tiny", max_length=64, attention_backend=backend)
    model = NeoBERTForMaskedLM(config).train()
    model.set_validate_inputs(False)  # as in the training step
    masker = MLMMasker.from_tokenizer(tokenizer, rate=0.3)
    docs = _docs(LENGTHS, seed=1)
    padded = masker.collate_padded(docs, torch.Generator().manual_seed(5))
    unpadded = masker.collate_unpadded(docs, torch.Generator().manual_seed(5))

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        kwargs = {"masked_index": batch["masked_index"]} if masked == "index" else {}
        if "cu_seqlens" in batch:
            kwargs.update(cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
        loss = model(batch["input_ids"], batch.get("attention_mask"), labels=batch["labels"], **kwargs).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    padded_loss, padded_grads = loss_and_grads(padded)
    unpadded_loss, unpadded_grads = loss_and_grads(unpadded)
    assert padded_loss > 0
    torch.testing.assert_close(unpadded_loss, padded_loss, atol=1e-5, rtol=1e-5)
    assert padded_grads.keys() == unpadded_grads.keys() and len(padded_grads) == len(list(model.parameters()))
    for name in padded_grads:
        torch.testing.assert_close(unpadded_grads[name], padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def _data(tmp_path, **kw):
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        with path.open("w") as f:
            for doc in demo_documents()[:120]:
                f.write(json.dumps(doc) + "\n")
    values = dict(source=str(path), max_length=48, shuffle_buffer=50, num_workers=0)
    values.update(kw)
    return PretrainDataConfig(**values)


def test_the_stream_with_packing_none_yields_unpadded_batches(tmp_path, tokenizer):
    assert PretrainDataConfig().unpad is True and PretrainDataConfig().packing == "none"  # the paper's config, unpadded
    take = lambda data: [b for _, b in zip(range(12), PretrainingStream(data, MaskingConfig(), tokenizer, 4))]  # noqa: E731
    padded, unpadded = take(_data(tmp_path, unpad=False)), take(_data(tmp_path))
    saw_padding = False
    for p, u in zip(padded, unpadded):
        keep = p["attention_mask"].bool()
        saw_padding |= not bool(keep.all())
        assert set(u) == {"input_ids", "labels", "cu_seqlens", "max_seqlen", "masked_index", DATA_STATE_KEY}
        assert (u["input_ids"] != tokenizer.pad_token_id).all()
        assert torch.equal(u["input_ids"][0], p["input_ids"][keep]) and torch.equal(u["labels"][0], p["labels"][keep])
        lengths = keep.sum(1)
        assert u["cu_seqlens"][1:].diff(prepend=torch.zeros(1, dtype=torch.int32)).tolist() == lengths.tolist()
        assert u["max_seqlen"] == int(lengths.max()) <= 48  # truncated to data.max_length; no multiple of 8
        stats_p, stats_u = p[DATA_STATE_KEY]["stats"], u[DATA_STATE_KEY]["stats"]
        assert stats_u == stats_p and stats_u["squared_lengths"] == int((lengths**2).sum())
        assert u[DATA_STATE_KEY]["state"].batches == p[DATA_STATE_KEY]["state"].batches
    assert saw_padding, "the corpus gave no padded batch: the comparison would prove nothing"


def test_the_pretraining_job_trains_unpadded_with_packing_none(tmp_path):
    class Keys(L.Callback):
        seen: list = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.seen.append((set(batch), module.model.model.config.attention_backend))

    keys = Keys()
    config = tiny_config(tmp_path, "trainer.max_steps=2")
    assert config.data.packing == "none" and config.data.unpad
    assert build_model_config(config, load_tokenizer()).attention_backend == "varlen"
    run_pretraining(config, [keys])
    assert len(keys.seen) == 2
    for batch_keys, backend in keys.seen:
        assert "cu_seqlens" in batch_keys and "attention_mask" not in batch_keys and backend == "varlen"
    off = tiny_config(tmp_path / "off", "data.unpad=false")
    assert build_model_config(off, load_tokenizer()).attention_backend == "sdpa"


# ---------------------------------------------------------------------------------------------- xFormers
def _reference_attention(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        out.append(F.scaled_dot_product_attention(*(t[s].transpose(0, 1) for t in (q, k, v))).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.fixture
def stand_in_xformers(monkeypatch):
    """An `xformers.ops.fmha` that computes block-diagonal attention on CPU, and the packed path routed to it."""
    built = []

    class BlockDiagonalMask:
        def __init__(self, lengths):
            self.lengths = lengths

        @classmethod
        def from_seqlens(cls, lengths):
            assert all(type(n) is int for n in lengths), "xFormers takes the lengths as Python ints"
            built.append(lengths)
            return cls(lengths)

    def memory_efficient_attention(q, k, v, attn_bias, p=0.0):
        return _reference_attention(q[0], k[0], v[0], attn_bias.lengths)[None]

    fmha = types.SimpleNamespace(BlockDiagonalMask=BlockDiagonalMask,
                                 memory_efficient_attention=memory_efficient_attention)
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha
    package = types.ModuleType("xformers")
    package.ops = ops
    monkeypatch.setitem(sys.modules, "xformers", package)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    monkeypatch.setattr(attention, "packed_kernel",
                        lambda device_type, dtype, dropout_p, head_dim=None, training=True, capability=None: "xformers")
    return built


def test_xformers_reads_the_lengths_once_per_forward_not_per_layer(tokenizer, stand_in_xformers):
    torch.manual_seed(0)
    config = NeoBERTConfig.from_preset("tiny", num_hidden_layers=5, max_length=64)
    model = NeoBERTForMaskedLM(config).eval()
    model.set_validate_inputs(False)  # the training step's forward: its own checks would read the device too
    batch = MLMMasker.from_tokenizer(tokenizer).collate_unpadded(_docs(LENGTHS), torch.Generator().manual_seed(0))
    with torch.no_grad(), HostReads() as watch:
        out = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"]).logits
    assert watch.reads.count("tolist") == 1 and watch.reads == ["tolist"], watch.reads
    assert stand_in_xformers == [LENGTHS]  # one mask for the 5 layers
    # The path gives each document what it gets alone (padded path: no cu_seqlens, no xFormers).
    with torch.no_grad():
        for start, end in zip(batch["cu_seqlens"][:-1].tolist(), batch["cu_seqlens"][1:].tolist()):
            alone = model(batch["input_ids"][:, start:end]).logits[0]
            torch.testing.assert_close(out[0, start:end], alone, atol=1e-5, rtol=1e-4)
