import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from neobert.model import NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM, NeoBERTForSequenceClassification, pool_embeddings
from neobert.model.rope import apply_rope, rope_tables
from neobert.model.layers import SwiGLU


def random_padded_batch(vocab, lengths, total=None):
    total = total or max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), total))
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def naive_encoder(model: NeoBERT, ids: torch.Tensor) -> torch.Tensor:
    """An independent reading of the spec for one unpadded sequence: explicit softmax(QK^T/sqrt d)V with the
    per-head interleaved qkv rows and the complex-pair RoPE (torch.view_as_complex, as the LLaMA code)."""
    config = model.config
    heads, d = config.num_attention_heads, config.head_dim
    x = model.encoder.weight[ids]  # [L, H]
    length = ids.shape[0]
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d))
    rotation = torch.polar(torch.ones(length, d // 2), torch.outer(torch.arange(length).float(), freqs))

    def rope(t):  # t [L, heads, d]
        c = torch.view_as_complex(t.reshape(length, heads, d // 2, 2))
        return torch.view_as_real(c * rotation[:, None, :]).reshape(length, heads, d)

    def rms(t, norm):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.norm_eps) * norm.weight

    for block in model.transformer_encoder:
        h = rms(x, block.attention_norm)
        qkv = h @ block.qkv.weight.T  # [L, 3H]
        per_head = qkv.reshape(length, heads, 3 * d)
        q, k, v = per_head[..., :d], per_head[..., d:2 * d], per_head[..., 2 * d:]
        q, k = rope(q), rope(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, heads * d)
        x = x + attn @ block.wo.weight.T
        h = rms(x, block.ffn_norm)
        gate_up = h @ block.ffn.w12.weight.T
        gate, up = gate_up[:, :gate_up.shape[1] // 2], gate_up[:, gate_up.shape[1] // 2:]
        x = x + (F.silu(gate) * up) @ block.ffn.w3.weight.T
    return rms(x, model.layer_norm)


def test_encoder_matches_naive_reference(tiny_config):
    model = NeoBERT(tiny_config).eval()
    ids = torch.randint(1, tiny_config.vocab_size, (1, 17))
    with torch.no_grad():
        ours = model(ids).last_hidden_state[0]
        reference = naive_encoder(model, ids[0])
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "bert-base"])
def test_sdpa_and_varlen_agree_on_variable_length_batches(preset):
    config = NeoBERTConfig.from_preset(preset, vocab_size=500, dropout=0.0, max_length=64, num_hidden_layers=2,
                                       hidden_size=64, num_attention_heads=4, intermediate_size=128)
    sdpa = NeoBERT(config).eval()
    varlen = NeoBERT(dataclasses.replace(config, attention_backend="varlen")).eval()
    varlen.load_state_dict(sdpa.state_dict())
    ids, mask = random_padded_batch(500, [33, 7, 1, 20])
    with torch.no_grad():
        a = sdpa(ids, mask).last_hidden_state
        b = varlen(ids, mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)


def test_packed_documents_do_not_attend_to_each_other_and_restart_positions(tiny_config):
    model = NeoBERT(tiny_config).eval()
    docs = [torch.randint(1, 1000, (n,)) for n in (5, 11, 3)]
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], cu_seqlens=cu).last_hidden_state[0]
        for doc, start in zip(docs, cu[:-1].tolist()):
            alone = model(doc[None]).last_hidden_state[0]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_padding_never_changes_real_token_outputs(tiny_config, backend):
    model = NeoBERT(dataclasses.replace(tiny_config, attention_backend=backend)).eval()
    ids, mask = random_padded_batch(1000, [9], total=9)
    padded_ids = torch.cat([ids, torch.randint(1, 1000, (1, 23))], dim=1)  # junk ids under the padding
    padded_mask = torch.cat([mask, torch.zeros(1, 23, dtype=torch.long)], dim=1)
    with torch.no_grad():
        short = model(ids, mask).last_hidden_state
        long = model(padded_ids, padded_mask).last_hidden_state
    torch.testing.assert_close(long[:, :9], short, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def score(pos_q, pos_k):
        rq = rope_tables(32, torch.tensor([pos_q]), 10000.0)
        rk = rope_tables(32, torch.tensor([pos_k]), 10000.0)
        return (apply_rope(q, rq) * apply_rope(k, rk)).sum()

    for shift in (1, 17, 1000):
        torch.testing.assert_close(score(3, 10), score(3 + shift, 10 + shift), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(score(3, 10), score(3, 11))


def test_masked_only_logits_equal_full_logits_at_masked_positions(tiny_config):
    model = NeoBERTForMaskedLM(tiny_config).eval()
    ids, mask = random_padded_batch(1000, [12, 8])
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 5], labels[0, 10] = 7, 8, 9
    with torch.no_grad():
        full = model(ids, mask, labels=labels)
        sparse = model(ids, mask, labels=labels, masked_only=True)
    torch.testing.assert_close(sparse.logits, full.logits[labels != -100])
    torch.testing.assert_close(sparse.loss, full.loss)


def test_classification_head_and_losses(tiny_config):
    model = NeoBERTForSequenceClassification(dataclasses.replace(tiny_config, num_labels=3)).eval()
    ids, mask = random_padded_batch(1000, [6, 4])
    out = model(ids, mask, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss.ndim == 0
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\)"):
        model(ids, mask, labels=torch.tensor([0, 3]))
    regression = NeoBERTForSequenceClassification(dataclasses.replace(tiny_config, num_labels=1))
    out = regression(ids, mask, labels=torch.tensor([0.5, 4.0]))
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), torch.tensor([0.5, 4.0])))


def test_mean_pooling_ignores_padding():
    hidden = torch.tensor([[[1.0, 1.0], [3.0, 3.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(pool_embeddings(hidden, mask), torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(pool_embeddings(hidden, mask, "cls"), torch.tensor([[1.0, 1.0]]))


@pytest.mark.parametrize("call,message", [
    (lambda m: m(torch.tensor([[1, 2, 1000]])), r"token ids must be in \[0, 1000\)"),
    (lambda m: m(torch.tensor([[1, -1]])), r"token ids must be in"),
    (lambda m: m(torch.ones(1, 65, dtype=torch.long)), "sequence length 65 exceeds max_length=64"),
    (lambda m: m(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4)), "does not match input_ids shape"),
    (lambda m: m(torch.ones(0, 5, dtype=torch.long)), "empty batch"),
    (lambda m: m(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [0, 0, 0]])), "no real token"),
    (lambda m: m(torch.ones(2, 3)), "integer token ids"),
    (lambda m: m(torch.ones(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 4])), "cu_seqlens must run"),
    # a max_seqlen under the longest document: the kernels would size their work by it, and overlap documents
    (lambda m: m(torch.ones(16, dtype=torch.long), cu_seqlens=torch.tensor([0, 12, 14, 16]), max_seqlen=8),
     "max_seqlen=8 is less than the longest document's 12 tokens"),
])
def test_bad_input_is_a_clear_value_error(tiny_config, call, message):
    with pytest.raises(ValueError, match=message):
        call(NeoBERT(tiny_config))


def test_mlm_labels_are_checked(tiny_config):
    model = NeoBERTForMaskedLM(tiny_config)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="labels must be -100 or token ids"):
        model(ids, labels=torch.tensor([[-100, 5000, -100, -100]]))
    with pytest.raises(ValueError, match="masked_only=True needs labels"):
        model(ids, masked_only=True)


def test_compiled_rope_path_equals_eager(monkeypatch):
    x = torch.randn(2, 5, 3, 8)
    rotations = rope_tables(8, torch.arange(5), 10000.0)
    eager = apply_rope(x, rotations)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(apply_rope(x, rotations), eager)


def test_rope_on_q_and_k_side_by_side_equals_rope_on_each():
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)
    rotations = rope_tables(8, torch.arange(5).expand(2, 5), 10000.0)
    together = apply_rope(torch.cat((q, k), dim=-1), rotations)
    # Equal up to float32 rounding (the vectorised complex multiply may fuse differently for a longer last axis).
    separately = torch.cat((apply_rope(q, rotations), apply_rope(k, rotations)), dim=-1)
    torch.testing.assert_close(together, separately, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(together[..., :8], q)


def test_swiglu_in_place_without_autograd_equals_the_autograd_path():
    ffn = SwiGLU(8, 16)
    x = torch.randn(2, 3, 8)
    with_grad = ffn(x)
    assert with_grad.requires_grad
    with_grad.sum().backward()  # the autograd path is not in place
    assert ffn.w12.weight.grad is not None
    with torch.no_grad():
        no_grad = ffn(x)
    with torch.inference_mode():
        inference = ffn(x)
    assert torch.equal(no_grad, with_grad.detach()) and torch.equal(inference, with_grad.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_predicted_ids_are_the_argmax_first_of_equal_maxima(dtype):
    from neobert.model.modeling import MaskedLMOutput

    logits = torch.randn(6, 50).to(dtype)
    logits[0, 7] = logits[0, 31] = logits[0].max() + 1  # a tie: the first index wins, as argmax's
    logits[1] = 0.0
    predicted = MaskedLMOutput(logits=logits).predicted_ids()
    assert torch.equal(predicted, logits.float().argmax(-1)) and predicted[0] == 7 and predicted[1] == 0
    fused = torch.tensor([3, -1])  # the fused loss gives its predictions instead of logits
    assert MaskedLMOutput(logits=None, predictions=fused).predicted_ids() is fused
