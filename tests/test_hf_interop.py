import pytest
import torch
from transformers import (AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification,
                          AutoTokenizer)

import neobert  # noqa: F401  (registers the Auto classes)
from neobert.data.tokenizer import load_tokenizer
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM


@pytest.fixture
def export_dir(tmp_path):
    config = NeoBERTConfig.from_preset("tiny")
    model = NeoBERTForMaskedLM(config).eval()
    model.save_pretrained(tmp_path, tokenizer=load_tokenizer(max_length=config.max_length))
    return tmp_path, model


def test_auto_classes_load_our_export_without_remote_code(export_dir):
    directory, model = export_dir
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(["a short one", "and a somewhat longer sentence here"], padding=True, return_tensors="pt")
    assert batch["attention_mask"].min() == 0
    assert AutoConfig.from_pretrained(directory).model_type == "neobert"
    with torch.no_grad():
        ours = model(batch["input_ids"], batch["attention_mask"])
        hf_mlm = AutoModelForMaskedLM.from_pretrained(directory).eval()(**batch)
        hf_base = AutoModel.from_pretrained(directory).eval()(**batch)  # token_type_ids accepted and ignored
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hf_mlm.logits[real], ours.logits[real])
    torch.testing.assert_close(hf_base.last_hidden_state[real], ours.last_hidden_state[real])
    classifier = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=3).eval()
    with torch.no_grad():
        logits = classifier(**batch).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()
    # The new head is initialised, not left empty.
    assert classifier.classifier.weight.abs().sum() > 0


def test_hf_save_pretrained_round_trips_the_hub_layout(export_dir, tmp_path_factory):
    directory, model = export_dir
    hf = AutoModelForMaskedLM.from_pretrained(directory)
    again = tmp_path_factory.mktemp("again")
    hf.save_pretrained(again)
    reloaded = NeoBERTForMaskedLM.from_pretrained(again)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[key]), key
