"""The GLUE callback of pretraining runs: it logs `glue/<task>/<metric>` every N steps and leaves the pretraining
run exactly as it would have been without it (same RNG draws, same weights)."""

import csv

import lightning as L
import pytest
import torch
from glue_files import write_parquet_task
from torch.utils.data import DataLoader, TensorDataset

from neobert.config.pretrain import GlueCallbackConfig
from neobert.data.tokenizer import load_tokenizer
from neobert.lit.glue_callback import GlueEvalCallback
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM


class FakePretraining(L.LightningModule):
    """Exposes `.model` (NeoBERTForMaskedLM) and `.tokenizer` like the pretraining module; draws its masks from the
    global torch RNG, so any RNG the callback consumed without restoring would change the trained weights."""

    def __init__(self):
        super().__init__()
        self.model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", max_length=64))
        self.tokenizer = load_tokenizer(max_length=64)

    def training_step(self, batch, batch_idx):
        (input_ids,) = batch
        mask = torch.rand(input_ids.shape) < 0.2
        labels = torch.where(mask, input_ids, torch.full_like(input_ids, -100))
        return self.model(input_ids.masked_fill(mask, self.tokenizer.mask_token_id), labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def pretrain(tmp_path, callbacks, name):
    L.seed_everything(0, verbose=False)
    module = FakePretraining()
    ids = torch.randint(1000, 2000, (32, 16), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(max_steps=4, accelerator="cpu", callbacks=callbacks, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path, name=name, version=""))
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=4, shuffle=True))
    return module, trainer


def test_glue_callback_logs_scores_and_leaves_pretraining_untouched(tmp_path):
    write_parquet_task(tmp_path / "glue", "rte", n_train=32, n_eval=16)
    config = GlueCallbackConfig(every_n_steps=2, task="rte", data_path=str(tmp_path / "glue"), max_train_steps=2,
                                batch_size=8, max_length=64)
    with_callback, trainer = pretrain(tmp_path, [GlueEvalCallback(config)], "with")
    without_callback, _ = pretrain(tmp_path, [], "without")
    for (name, a), (_, b) in zip(with_callback.state_dict().items(), without_callback.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    with open(tmp_path / "with" / "metrics.csv") as handle:
        logged = {int(r["step"]): float(r["glue/rte/accuracy"]) for r in csv.DictReader(handle)
                  if r.get("glue/rte/accuracy")}
    assert sorted(logged) == [2, 4] and all(0.0 <= x <= 1.0 for x in logged.values())
    assert "glue/rte/accuracy" in trainer.callback_metrics


def test_glue_callback_off_by_default_and_validates_its_config():
    callback = GlueEvalCallback(GlueCallbackConfig())
    assert callback.config.every_n_steps == 0
    with pytest.raises(ValueError, match="max_train_steps"):
        GlueEvalCallback(GlueCallbackConfig(every_n_steps=10, max_train_steps=0))
    with pytest.raises(ValueError, match="unknown GLUE task"):
        GlueEvalCallback(GlueCallbackConfig(every_n_steps=10, task="squad"))
