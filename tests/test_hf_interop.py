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


def test_the_auto_mlm_class_takes_labels_checks_them_and_takes_the_decoder_padding_at_load(export_dir):
    """What transformers' Trainer does with an MLM: labels in, the loss out (it once raised AttributeError: the
    wrapper lacked the label check's helper), out-of-range labels refused; the padded decoder chosen at load gives the
    same loss and logits."""
    directory, model = export_dir
    ids = torch.randint(5, 1000, (2, 10))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[1, 7] = ids[0, 2], ids[1, 7]
    with torch.no_grad():
        ours = model(ids, labels=labels)
        for hf in (AutoModelForMaskedLM.from_pretrained(directory).eval(),
                   AutoModelForMaskedLM.from_pretrained(directory, decoder_pad_multiple=64).eval()):
            out = hf(input_ids=ids, labels=labels)
            torch.testing.assert_close(out.loss, ours.loss)
            torch.testing.assert_close(out.logits, ours.logits)
        assert hf.config.decoder_pad_multiple == 64
        labels[0, 3] = model.config.vocab_size
        with pytest.raises(ValueError, match="labels must be -100 or token ids"):
            hf(input_ids=ids, labels=labels)


def test_hf_save_pretrained_round_trips_the_hub_layout(export_dir, tmp_path_factory):
    directory, model = export_dir
    hf = AutoModelForMaskedLM.from_pretrained(directory)
    again = tmp_path_factory.mktemp("again")
    hf.save_pretrained(again)
    reloaded = NeoBERTForMaskedLM.from_pretrained(again)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[key]), key
