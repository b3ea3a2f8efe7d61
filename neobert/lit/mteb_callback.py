"""Zero-shot MTEB during pretraining: every `every_n_steps` steps, the encoder inside the pretraining module is
evaluated on a small local STS or retrieval task and the scores are logged as `mteb/<task>/<score>` (e.g.
`mteb/sts/cosine_spearman`). Off by default (every_n_steps = 0).

The pretraining module must expose the encoder as `pl_module.model.model` (NeoBERTForMaskedLM.model) and its
tokenizer as `pl_module.tokenizer`.
"""

from __future__ import annotations

import logging

import lightning as L

from neobert.config.pretrain import MtebCallbackConfig
from neobert.data.backbone import Backbone

log = logging.getLogger(__name__)

# The main scores logged per task kind (a few more than the main one, all cheap once embeddings exist).
_LOGGED_SCORES = {"sts": ("cosine_spearman", "cosine_pearson"),
                  "retrieval": ("ndcg_at_10", "mrr_at_10", "recall_at_10"),
                  "beir": ("ndcg_at_10", "mrr_at_10", "recall_at_100")}


class MtebEvalCallback(L.Callback):
    def __init__(self, config: MtebCallbackConfig):
        super().__init__()
        config.validate()  # also when built in Python rather than loaded from YAML
        self.config = config
        self._task = None
        self._limit_logged = False

    def _make_task(self):
        from neobert.eval.mteb import local_task  # imports mteb (heavy): only when on

        return local_task(self.config.task, self.config.data_path, name=f"pretrain-{self.config.task}",
                          max_examples=self.config.max_examples)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.config.every_n_steps <= 0 or step == 0 or step % self.config.every_n_steps:
            return
        if not trainer.is_global_zero:  # one process evaluates; the others wait for it at the next collective
            return
        for name, value in self.evaluate(pl_module).items():
            pl_module.log(f"mteb/{self.config.task}/{name}", value, rank_zero_only=True)

    def evaluate(self, pl_module: L.LightningModule) -> dict[str, float]:
        from neobert.eval.mteb import MtebEncoder, score_tasks  # imports mteb (heavy): only when on

        if self._task is None:
            self._task = self._make_task()
        encoder = pl_module.model.model
        backbone = Backbone(encoder, pl_module.tokenizer, encoder.config.hidden_size,
                            encoder.config.num_hidden_layers, is_neobert=True)
        device = str(next(encoder.parameters()).device)
        mteb_encoder = MtebEncoder(backbone, batch_size=self.config.batch_size, max_length=self.config.max_length,
                                   device=device, name="pretraining", max_length_key="mteb_callback.max_length")
        if not self._limit_logged:
            # A quick trend during pretraining, cut shorter than the model reads (a BEIR task's documents are
            # then scored on their start): the log says so, once; experiments.mteb uses the model's own limit.
            self._limit_logged = True
            log.info("zero-shot MTEB %s: texts truncated to %d tokens (%s)", self.config.task,
                     mteb_encoder.length_limit.tokens, mteb_encoder.length_limit.source)
        per_task = score_tasks(mteb_encoder, [self._task], batch_size=self.config.batch_size,
                               show_progress_bar=False)
        scores = per_task[self._task.metadata.name]["scores"]
        split_scores = next(iter(scores.values()))[0]
        log.info("zero-shot MTEB %s: %s", self.config.task,
                 {k: round(split_scores[k], 4) for k in _LOGGED_SCORES[self.config.task]})
        return {k: float(split_scores[k]) for k in _LOGGED_SCORES[self.config.task]}
