import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import shared_data
from neobert.model import (NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM, NeoBERTForSequenceClassification,
                           convert_official_state_dict)


def test_official_tiny_checkpoint_loads_and_matches_official_outputs():
    directory = shared_data("official_tiny")
    model = NeoBERTForMaskedLM.from_pretrained(directory).eval()
    ref = load_file(str(directory / "reference.safetensors"))
    real = ref["attention_mask"].bool()
    assert not real.all(), "the reference batch is padded"
    for backend in ("sdpa", "varlen"):
        model.model.config.attention_backend = backend
        with torch.no_grad():
            out = model(ref["input_ids"], ref["attention_mask"])
        torch.testing.assert_close(out.last_hidden_state[real], ref["last_hidden_state"][real], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(out.logits[real], ref["logits"][real], atol=2e-6, rtol=1e-5)
    # Same weights as the bare encoder (the `model.` prefix is stripped, the decoder dropped).
    encoder = NeoBERT.from_pretrained(directory)
    torch.testing.assert_close(encoder.encoder.weight, model.model.encoder.weight)


def test_save_load_round_trip_is_bit_exact(tmp_path, tiny_config):
    model = NeoBERTForMaskedLM(tiny_config)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "neobert" and config["architectures"] == ["NeoBERTLMHead"]
    loaded = NeoBERTForMaskedLM.from_pretrained(tmp_path)
    assert loaded.config == model.config
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[key]), key


def test_mlm_checkpoint_starts_a_classifier_with_a_fresh_head(tmp_path, tiny_config):
    NeoBERTForMaskedLM(tiny_config).save_pretrained(tmp_path)
    classifier = NeoBERTForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert classifier.classifier.weight.shape == (3, tiny_config.hidden_size)
    classifier.save_pretrained(tmp_path / "cls")
    again = NeoBERTForSequenceClassification.from_pretrained(tmp_path / "cls")
    assert torch.equal(again.classifier.weight, classifier.classifier.weight)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.transformer_encoder.1.wo.weight"), r"missing tensors: \['model.transformer_encoder.1.wo.weight'\]"),
    (lambda s: s.__setitem__("model.extra.weight", torch.zeros(2)), r"unexpected tensors: \['model.extra.weight'\]"),
    (lambda s: s.__setitem__("model.layer_norm.weight", torch.ones(3)), r"mis-shaped tensors: \['model.layer_norm.weight"),
])
def test_mismatched_checkpoint_names_the_tensor(tmp_path, tiny_config, edit, message):
    NeoBERTForMaskedLM(tiny_config).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        NeoBERTForMaskedLM.from_pretrained(tmp_path)


def test_corrupt_or_missing_files_are_clear_errors(tmp_path, tiny_config):
    NeoBERTForMaskedLM(tiny_config).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        NeoBERTForMaskedLM.from_pretrained(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        NeoBERTForMaskedLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        NeoBERTForMaskedLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NeoBERTForMaskedLM.from_pretrained(tmp_path / "nowhere")


def test_official_training_state_dict_converts(tmp_path, tiny_config):
    model = NeoBERTForMaskedLM(tiny_config)
    # The official trainer's file: DDP + torch.compile prefixes and the nn.Sequential SwiGLU names.
    raw = {}
    for key, tensor in model.state_dict().items():
        key = key.replace("ffn.w12.", "ffn.0.").replace("ffn.w3.", "ffn.2.")
        raw["module._orig_mod." + key] = tensor.clone()
    torch.save(raw, tmp_path / "state_dict.pt")
    converted = convert_official_state_dict(tmp_path / "state_dict.pt", tiny_config, tmp_path / "hub")
    reloaded = NeoBERTForMaskedLM.from_pretrained(tmp_path / "hub")
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[key]) and torch.equal(tensor, converted.state_dict()[key])
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable torch state dict"):
        convert_official_state_dict(tmp_path / "bad.pt", tiny_config, tmp_path / "x")


def test_hub_config_without_optional_fields_uses_official_defaults(tmp_path):
    directory = shared_data("official_tiny")
    hub = json.loads((directory / "config.json").read_text())
    config = NeoBERTConfig.from_hub_dict(hub)
    assert (config.hidden_size, config.num_attention_heads, config.ffn_hidden_size, config.max_length) == (48, 3, 80, 128)


def test_convert_official_cli(tmp_path):
    from experiments.convert_official import main

    config = NeoBERTConfig.from_preset("tiny")
    model = NeoBERTForMaskedLM(config)
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, tmp_path / "state_dict.pt")
    main([str(tmp_path / "state_dict.pt"), str(tmp_path / "hub"), "--preset", "tiny"])
    reloaded = NeoBERTForMaskedLM.from_pretrained(tmp_path / "hub")
    assert torch.equal(reloaded.decoder.weight, model.decoder.weight)
    assert (tmp_path / "hub" / "tokenizer_config.json").is_file()
