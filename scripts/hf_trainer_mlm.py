"""The plain Hugging Face `Trainer` baseline for MLM pretraining, to compare with `python -m experiments.pretrain`:
the same config (a packaged name or a YAML file, then key=value overrides), read by the same loader: the same model
(preset and overrides, initialised as ours from trainer.seed, run through its `transformers` class), the same
training documents (data.source and data.text_column, the first data.validation_docs held out, truncated to
data.max_length), the same masking rate and strategy, the same optimizer and lr schedule (built from the config's
sections by `neobert.lit.optim`), clipping, batch, steps and seed; but `DataCollatorForLanguageModeling` (padded
batches, logits at every position) and the `Trainer` loop. The trained weights go to <output-dir>/export in the
export layout, so `experiments.heldout` scores them beside a run of ours on the same documents and masks:

    python scripts/hf_trainer_mlm.py --config demo data.source=runs/mlm/train.jsonl trainer.max_steps=400 \
        --output-dir runs/mlm/trainer
    python -m experiments.heldout ours=runs/mlm/ours/export trainer=runs/mlm/trainer/export \
        --source heldout=runs/mlm/heldout.jsonl --documents 600 --output-dir runs/mlm
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from neobert.config import ConfigError
from neobert.config.pretrain import PretrainConfig
from neobert.data.corpus import iterate_documents, truncate
from neobert.data.tokenizer import load_tokenizer
from neobert.jobs.pretrain import build_model_config, load_pretrain_config
from neobert.layout import EXPORT_DIR
from neobert.lit.optim import configure_optimizers
from neobert.lit.trainer import resolve_precision
from neobert.model import NeoBERTForMaskedLM
from neobert.model.hf import NeoBERTHFConfig, NeoBERTHFForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_trainer_baseline.py, also when loaded by file path
from hf_trainer_baseline import parse_args, script_parser, write_results  # noqa: E402

# Trainer's mixed-precision flags for the config's trainer.precision
PRECISION_FLAGS = {"32": {}, "32-true": {}, "bf16-mixed": {"bf16": True}, "16-mixed": {"fp16": True}}


def check_plain_settings(config: PretrainConfig) -> None:
    """The settings a padded `DataCollatorForLanguageModeling` batch of one source cannot reproduce are refused."""
    unsupported = {"data.packing": config.data.packing != "none", "data.sources": bool(config.data.sources),
                   "masking.rate_schedule": bool(config.masking.rate_schedule), "phases": bool(config.phases),
                   "trainer.precision": resolve_precision(config.trainer) not in PRECISION_FLAGS,
                   "trainer.batch_size_warmup": bool(config.trainer.batch_size_warmup.tokens)}
    for key, is_set in unsupported.items():
        if is_set:
            raise ConfigError(f"invalid config key {key!r}: the plain Trainer baseline trains one source's documents, "
                              f"truncated and padded, at one masking rate and batch size, in "
                              f"{' or '.join(PRECISION_FLAGS)} precision")


def training_documents(config: PretrainConfig, tokenizer) -> Dataset:
    """The token ids of the documents ours trains on (after the held-out data.validation_docs), truncated alike."""
    special = set(tokenizer.all_special_ids)
    documents = iterate_documents(config.data, tokenizer)
    return Dataset.from_dict({"input_ids": [truncate(ids, config.data.max_length, special) for ids in documents]})


def initial_model(config: PretrainConfig, tokenizer) -> NeoBERTHFForMaskedLM:
    """The `transformers` class of the model, with the weights ours starts from at trainer.seed (built after
    seeding, as the pretraining job builds its LightningModule's), on padded batches (attention_backend as the
    config sets it, not the one ours derives for its unpadded batches)."""
    config.data.unpad = False  # padded documents: derived_model_overrides adds nothing
    model_config = build_model_config(config, tokenizer)
    torch.manual_seed(config.trainer.seed)
    ours = NeoBERTForMaskedLM(model_config)
    model = NeoBERTHFForMaskedLM(NeoBERTHFConfig(**model_config.to_hub_dict()))
    model.load_state_dict(ours.state_dict())
    return model


def training_arguments(config: PretrainConfig, output_dir: str) -> TrainingArguments:
    trainer = config.trainer
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=trainer.micro_batch_size,
        gradient_accumulation_steps=trainer.accumulate_grad_batches, max_steps=trainer.max_steps,
        max_grad_norm=trainer.gradient_clip_val, seed=trainer.seed, data_seed=config.data.seed,
        logging_steps=config.logging.log_every_n_steps, save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=trainer.accelerator == "cpu" or not torch.cuda.is_available(),
        dataloader_num_workers=config.data.num_workers, disable_tqdm=not config.logging.progress_bar,
        include_num_input_tokens_seen="non_padding", **PRECISION_FLAGS[resolve_precision(trainer)])


def export(model: NeoBERTHFForMaskedLM, config: PretrainConfig, tokenizer, directory: Path) -> None:
    """The trained weights in the export layout of `experiments.pretrain` (the same state dict names)."""
    exported = NeoBERTForMaskedLM(build_model_config(config, tokenizer))
    exported.load_state_dict({name: tensor.float().cpu() for name, tensor in model.state_dict().items()})
    exported.save_pretrained(directory, tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__, output_dir="runs/hf_trainer_mlm")
    parser.add_argument("--config", default=None, help="a packaged pretraining config or a YAML path (default: demo)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="as experiments.pretrain takes them")
    args = parse_args(parser, argv)
    config = load_pretrain_config(args.config, args.overrides)
    check_plain_settings(config)
    tokenizer = load_tokenizer(config.data.tokenizer, max_length=config.data.max_length, config_key="data.tokenizer")
    model = initial_model(config, tokenizer)
    all_mask = config.masking.strategy == "all_mask"  # else BERT's 80% [MASK], 10% random, 10% kept
    collator = DataCollatorForLanguageModeling(
        tokenizer, mlm_probability=config.masking.rate, mask_replace_prob=1.0 if all_mask else 0.8,
        random_replace_prob=0.0 if all_mask else 0.1, pad_to_multiple_of=config.masking.pad_to_multiple_of)
    schedule = configure_optimizers(model, config.optimizer, config.scheduler, config.trainer.max_steps)
    trainer = Trainer(model=model, args=training_arguments(config, args.output_dir),
                      train_dataset=training_documents(config, tokenizer), data_collator=collator,
                      optimizers=(schedule["optimizer"], schedule["lr_scheduler"]["scheduler"]))
    output = trainer.train()
    export(model, config, tokenizer, Path(args.output_dir) / EXPORT_DIR)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"train_seconds": output.metrics["train_runtime"], "steps": trainer.state.global_step,
              "tokens": trainer.state.num_input_tokens_seen, "final_loss": losses[-1] if losses else None,
              "losses": losses, "config": args.config, "overrides": args.overrides}
    write_results(args.output_dir, result, headline=("train_seconds", "steps", "tokens", "final_loss"))
    return result


if __name__ == "__main__":
    main()
