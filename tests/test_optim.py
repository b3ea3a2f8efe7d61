import pytest
import torch
from torch import nn

from neobert.lit.optim import build_adamw, parameter_groups, warmup_cosine, warmup_linear
from neobert.model import NeoBERTForMaskedLM


def test_paper_schedule_at_key_steps():
    factor = warmup_cosine(warmup_steps=2000, total_steps=1_000_000, decay_fraction=0.9, final_ratio=0.1)
    assert factor(0) == 0.0
    assert factor(1000) == pytest.approx(0.5)
    assert factor(2000) == pytest.approx(1.0)
    midpoint = 2000 + (900_000 - 2000) // 2
    assert factor(midpoint) == pytest.approx(0.55, abs=1e-5)  # halfway down the cosine: 0.1 + 0.9 / 2
    assert factor(900_000) == pytest.approx(0.1)
    assert factor(999_999) == pytest.approx(0.1)


def test_glue_schedule():
    factor = warmup_linear(warmup_steps=6, total_steps=100)
    assert [factor(0), factor(3), factor(6), factor(53), factor(100)] == pytest.approx([0, 0.5, 1, 0.5, 0])


def test_no_weight_decay_on_norms_biases_and_embeddings(tiny_config):
    model = NeoBERTForMaskedLM(tiny_config)
    decay, no_decay = parameter_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "model.transformer_encoder.0.qkv.weight" in names and "decoder.weight" in names
    assert not any("norm" in n or n.endswith("bias") or n == "model.encoder.weight" for n in names)
    assert no_decay["weight_decay"] == 0.0
    everything = parameter_groups(model, 0.1, decay_norms_biases_embeddings=True)
    assert len(everything) == 1
    optimizer = build_adamw(model, lr=6e-4, weight_decay=0.1)
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-8


def test_adamw_is_fused_on_cpu_and_steps_like_the_per_tensor_loop(tiny_config):
    torch.manual_seed(0)
    model = NeoBERTForMaskedLM(tiny_config)
    reference = NeoBERTForMaskedLM(tiny_config)
    reference.load_state_dict(model.state_dict())
    start = model.model.encoder.weight.detach().clone()
    fused = build_adamw(model, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW(parameter_groups(reference, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                             foreach=False)
    ids = torch.randint(5, tiny_config.vocab_size, (2, 8))
    for _ in range(3):
        for net, optimizer in ((model, fused), (reference, loop)):
            optimizer.zero_grad()
            net(ids, labels=ids).loss.backward()
            optimizer.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.allclose(model.model.encoder.weight, start)  # the steps did move the weights
