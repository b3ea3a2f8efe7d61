"""Contrastive fine-tuning, the whole job (paper Section 5.2): load the encoder and the data, train (or resume: the
checkpoints hold the data position too), export in our hub layout + sentence-transformers layout, and score an
optional local STS task before and after (and at the Matryoshka truncations).
`python -m experiments.contrastive` is its command line; docs/contrastive_mteb.md the guide.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L

from neobert.config.contrastive import ContrastiveConfig
from neobert.data.backbone import Backbone, load_backbone
from neobert.data.contrastive import ContrastiveDataModule
from neobert.layout import EXPORT_DIR, RESULTS_JSON, STS_TUNED_DIR, STS_ZERO_SHOT_DIR
from neobert.lit.checkpoints import (refuse_another_optimizer, refuse_existing_checkpoints, resume_checkpoint,
                                     step_checkpoint_callback)
from neobert.lit.contrastive import ContrastiveModule
from neobert.lit.trainer import build_trainer
from neobert.outputs import hold_output_dir

STS_TASK = "ContrastiveEvalSTS"


def run_contrastive(config: ContrastiveConfig) -> dict:
    """Fine-tunes, exports to `<output_dir>/export` (hub + sentence-transformers layout) and returns the
    summary (also in `<output_dir>/results.json`). The run holds its output_dir throughout
    (neobert.outputs.hold_output_dir): a second run into it is refused before it writes or removes anything."""
    with hold_output_dir(config.output_dir):
        return train_and_export(config)


def train_and_export(config: ContrastiveConfig) -> dict:
    """`run_contrastive` once its output_dir is held."""
    L.seed_everything(config.trainer.seed, workers=True)
    output_dir = Path(config.output_dir)
    if not config.resume:
        refuse_existing_checkpoints(output_dir)
    ckpt_path = resume_checkpoint(output_dir) if config.resume else None
    if ckpt_path is not None:
        refuse_another_optimizer(ckpt_path, config.optimizer.name, "choose another output_dir to start over")
    backbone = load_backbone(config.model, tokenizer=config.tokenizer, **config.model_overrides)
    datamodule = ContrastiveDataModule(config.data, backbone.tokenizer)
    datamodule.setup("fit")  # reads (or fails to reach) every data set before the model work starts

    before = sts_scores(config, backbone, output_dir / STS_ZERO_SHOT_DIR)
    module = ContrastiveModule(backbone, config.loss, config.optimizer, config.scheduler, config.trainer)
    # GradCache steps and clips itself (manual optimisation), and Lightning refuses a clip value then.
    clip = {} if module.automatic_optimization else {"gradient_clip_val": None}
    # Each rank takes its own slice of the same global batch (ContrastiveBatchSampler).
    every = config.trainer.checkpoint_every_n_steps
    callbacks = [step_checkpoint_callback(output_dir, config.trainer)] if every else []
    trainer = build_trainer(config.trainer, config.logging, output_dir, callbacks=callbacks,
                            use_distributed_sampler=False, **clip)
    with warnings.catch_warnings():
        # Lightning cannot see that the DataModule's state_dict holds the data position, and warns on resume.
        warnings.filterwarnings("ignore", message=".*your dataloader is not resumable")
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    export_dir = after = None
    if trainer.is_global_zero:  # one process writes; the others return what they know
        export_dir = module.export(output_dir / EXPORT_DIR)
        after = sts_scores(config, backbone, output_dir / STS_TUNED_DIR)
    result = {"model": config.model, "steps": trainer.global_step,
              "export": str(export_dir) if export_dir else None,
              "sts_zero_shot": before.get("full") if before else None,
              "sts_tuned": after.get("full") if after else None,
              "datasets": [c.name for c in datamodule.corpora]}
    if len(before or {}) > 1:  # truncated embeddings were scored too
        result["sts_zero_shot_by_dim"], result["sts_tuned_by_dim"] = before, after
    if trainer.is_global_zero:
        (output_dir / RESULTS_JSON).write_text(json.dumps(result, indent=2) + "\n")
    return result


def sts_scores(config: ContrastiveConfig, backbone: Backbone, output_dir: Path) -> dict[str, float] | None:
    """The cosine Spearman of `backbone` on the local STS file `config.eval_sts` (None when there is none), with
    the instruction MTEB's STS tasks get (STSBenchmark's in the instruction file): {"full": score} plus one entry
    per truncated size of `config.eval_sts_dims` (default: the Matryoshka dimensions)."""
    if config.eval_sts is None:
        return None
    # mteb is heavy: imported only when an STS file is scored.
    from neobert.eval.mteb import DEFAULT_INSTRUCTIONS, LocalSTSTask, MtebEncoder, TaskInstructions
    from neobert.jobs.mteb import run_mteb  # imports mteb too

    instruction = TaskInstructions.load(DEFAULT_INSTRUCTIONS).for_task("STSBenchmark")
    dims = [d for d in (config.eval_sts_dims or config.loss.matryoshka_dims) if d != backbone.hidden_size]
    scores, cache = {}, {}  # one embedding per text, truncated for each size
    for dim in [None, *dims]:
        encoder = MtebEncoder(backbone, TaskInstructions(query={STS_TASK: instruction}),
                              batch_size=config.data.batch_size, name=config.model, dim=dim, cache=cache)
        report = run_mteb(encoder, [LocalSTSTask(config.eval_sts, name=STS_TASK)],
                          output_dir if dim is None else output_dir / f"dim{dim}", config.data.batch_size,
                          show_progress_bar=False)
        scores["full" if dim is None else str(dim)] = report["tasks"][STS_TASK]["main_score"]
    return scores
