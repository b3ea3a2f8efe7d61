"""The pretraining MTEB callback evaluates `pl_module.model.model` on a local task every N steps and logs it."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from neobert.config.pretrain import MtebCallbackConfig
from neobert.lit.mteb_callback import MtebEvalCallback


@pytest.fixture(autouse=True)
def _offline_mteb(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class FakePretraining(L.LightningModule):
    """What the callback relies on: `model` (a NeoBERTForMaskedLM, encoder at `.model`) and `tokenizer`."""

    def __init__(self):
        super().__init__()
        from neobert.data.tokenizer import load_tokenizer
        from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

        self.model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", max_length=64))
        self.tokenizer = load_tokenizer(max_length=64)
        self.logged: dict[str, float] = {}

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[0], torch.ones_like(batch[0])).logits
        return logits.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def log(self, name, value, *args, **kwargs):
        self.logged[name] = value
        super().log(name, value, *args, **kwargs)


def test_callback_logs_sts_scores_every_n_steps(tmp_path):
    rows = [("A man plays a guitar.", "A man is playing guitar.", 4.6), ("A dog runs.", "The stock fell.", 0.2),
            ("A girl sings.", "A girl is singing.", 4.8), ("Cars race.", "A cat sleeps.", 0.5),
            ("He cooks pasta.", "A man is cooking noodles.", 3.6)]
    sts = tmp_path / "sts.csv"
    sts.write_text("".join(f"g\tf\t2012\t{i}\t{s}\t{a}\t{b}\n" for i, (a, b, s) in enumerate(rows)))
    callback = MtebEvalCallback(MtebCallbackConfig(every_n_steps=2, task="sts", data_path=str(sts), batch_size=4))
    calls = []
    evaluate = callback.evaluate
    callback.evaluate = lambda module: calls.append(module.global_step) or evaluate(module)

    module = FakePretraining()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(5, 1000, (5, 8))), batch_size=1)
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(module, data)
    assert calls == [2, 4]
    value = module.logged["mteb/sts/cosine_spearman"]
    assert -1.0 <= value <= 1.0 and value == value
    assert "mteb/sts/cosine_pearson" in trainer.callback_metrics
    assert module.model.training, "the callback must hand the model back in training mode"


def test_callback_is_off_by_default_and_checks_its_config():
    assert MtebEvalCallback(MtebCallbackConfig()).config.every_n_steps == 0
    with pytest.raises(ValueError, match="data_path"):
        MtebEvalCallback(MtebCallbackConfig(every_n_steps=10))
    with pytest.raises(ValueError, match="task"):
        MtebEvalCallback(MtebCallbackConfig(task="clustering"))
