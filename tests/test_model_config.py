import dataclasses

import pytest
import torch

from neobert.model import NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM

# NEOBERT_SPEC section 1: the hub state-dict of NeoBERTLMHead, per layer, with shapes (H=768, F=2048).
H, F, V = 768, 2048, 30522
LAYER_KEYS = {
    "qkv.weight": (3 * H, H),
    "wo.weight": (H, H),
    "ffn.w12.weight": (2 * F, H),
    "ffn.w3.weight": (H, F),
    "attention_norm.weight": (H,),
    "ffn_norm.weight": (H,),
}


def spec_state_dict_shapes():
    shapes = {"model.encoder.weight": (V, H), "model.layer_norm.weight": (H,), "decoder.weight": (V, H),
              "decoder.bias": (V,)}
    for i in range(28):
        for key, shape in LAYER_KEYS.items():
            shapes[f"model.transformer_encoder.{i}.{key}"] = shape
    return shapes


def test_neobert_state_dict_matches_spec_on_meta_device():
    with torch.device("meta"):
        model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("neobert"))
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == spec_state_dict_shapes()


@pytest.mark.parametrize("preset,encoder_m,with_head_m", [
    ("neobert", 221.7, 245.1),   # "about 222M encoder, 245M with LM head"
    ("bert-base", 108.8, 132.3),  # "about 108M encoder"
])
def test_parameter_counts_without_allocating(preset, encoder_m, with_head_m):
    config = NeoBERTConfig.from_preset(preset)
    with torch.device("meta"):
        encoder, mlm = NeoBERT(config), NeoBERTForMaskedLM(config)
    assert encoder.num_parameters() / 1e6 == pytest.approx(encoder_m, abs=0.1)
    assert mlm.num_parameters() / 1e6 == pytest.approx(with_head_m, abs=0.1)


def test_presets_carry_the_ablation_choices():
    neo, bert = NeoBERTConfig.from_preset("neobert"), NeoBERTConfig.from_preset("bert-base")
    assert (neo.num_hidden_layers, neo.hidden_size, neo.num_attention_heads, neo.ffn_hidden_size) == (28, 768, 12, 2048)
    assert (neo.position_encoding, neo.activation, neo.norm, neo.rope_theta, neo.norm_eps, neo.max_length) == (
        "rope", "swiglu", "rmsnorm", 10000.0, 1e-5, 4096)
    assert (bert.position_encoding, bert.activation, bert.norm, bert.ffn_hidden_size) == (
        "learned", "gelu", "layernorm", 3072)
    wide = NeoBERTConfig.from_preset("neobert-16x1056")
    assert (wide.num_hidden_layers, wide.hidden_size) == (16, 1056)
    with torch.device("meta"):
        assert NeoBERT(wide).num_parameters() / 1e6 == pytest.approx(246.4, abs=0.1)  # the paper's "250M" step


def test_unknown_preset_and_invalid_combinations_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        NeoBERTConfig.from_preset("nope")
    with pytest.raises(ValueError, match="unknown NeoBERTConfig field"):
        NeoBERTConfig.from_preset("tiny", hiden_size=3)
    with pytest.raises(ValueError, match="not divisible"):
        NeoBERTConfig(hidden_size=100, num_attention_heads=12)
    with pytest.raises(ValueError, match="position_encoding"):
        NeoBERTConfig(position_encoding="alibi")
    with pytest.raises(ValueError, match="head_dim=3 must be even"):
        NeoBERTConfig(hidden_size=12, num_attention_heads=4)
    with pytest.raises(ValueError, match="pad_token_id"):
        NeoBERTConfig(vocab_size=10, pad_token_id=10)


def test_hub_config_round_trip_keeps_every_field():
    config = NeoBERTConfig.from_preset("bert-base", dropout=0.2, num_labels=3)
    hub = config.to_hub_dict()
    assert hub["model_type"] == "neobert" and hub["dim_head"] == 64 and hub["norm_eps"] == 1e-12
    assert NeoBERTConfig.from_hub_dict(hub) == config
    with pytest.raises(ValueError, match="dim_head"):
        NeoBERTConfig.from_hub_dict({**hub, "dim_head": 32})
    assert dataclasses.replace(config) == config
