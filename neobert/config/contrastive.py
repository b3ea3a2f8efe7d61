"""The schema of a contrastive fine-tuning run (`python -m experiments.contrastive --config contrastive`) and the
registry of the paper's training sets (paper Section 5.2): which hub data set, which columns, which instruction.

Defaults are the paper's uniform protocol: InfoNCE at temperature 0.07, AdamW at lr 2e-5, 100 warm-up steps then
a linear decay over 2,000 steps, gradient clipping 1.0, bf16 mixed precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from neobert.config.common import (KERNELS_MOVED, LOGGING_KEYS_MOVED, OPTIMIZER_KEYS, LoggingConfig, OptimizerConfig,
                                   SchedulerConfig, TrainerConfig, check_load_time_overrides, check_optimizer_strategy)
from neobert.config.loader import require


@dataclass(frozen=True)
class ContrastiveSource:
    """A hub data set and how its columns map to (query, positive, negative)."""

    hub: str
    query: str
    positive: str
    negative: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    # STS-style sources: the score column, pairs at or above data.sts_min_score become positives.
    score: Optional[str] = None
    query_instruction: str = ""
    # None = the query instruction (symmetric tasks: both sides are the same kind of text).
    document_instruction: Optional[str] = None


_SIMILAR = "Retrieve semantically similar text."
_DUPLICATE = "Retrieve duplicate questions. Question: "

# The paper's training sets. Hub names are the sentence-transformers / mteb copies; they could not be checked
# from the firewalled machine this was written on (see docs/contrastive_mteb.md).
CONTRASTIVE_DATASETS: Dict[str, ContrastiveSource] = {
    "AGNews": ContrastiveSource("sentence-transformers/agnews", "title", "description",
                                query_instruction="Given a news title, retrieve the news article. Title: ",
                                document_instruction=""),
    "AllNLI": ContrastiveSource("sentence-transformers/all-nli", "anchor", "positive", "negative", subset="triplet",
                                query_instruction=_SIMILAR),
    "AmazonQA": ContrastiveSource("sentence-transformers/amazon-qa", "query", "answer",
                                  query_instruction="Given a product question, retrieve the answer. Question: ",
                                  document_instruction=""),
    "ConcurrentQA": ContrastiveSource("stanfordnlp/concurrentqa-retrieval", "question", "positive_passage",
                                      query_instruction="Given a multi-hop question, retrieve documents that "
                                                        "can help answer it. Question: ", document_instruction=""),
    "FEVER": ContrastiveSource("sentence-transformers/fever", "claim", "evidence", "negative",
                               query_instruction="Given a claim, retrieve documents that support or refute "
                                                 "the claim. Claim: ", document_instruction=""),
    "GithubIssues": ContrastiveSource("sentence-transformers/github-issues", "title", "body",
                                      query_instruction="Given a GitHub issue title, retrieve its description. "
                                                        "Title: ", document_instruction=""),
    "GooAQ": ContrastiveSource("sentence-transformers/gooaq", "question", "answer",
                               query_instruction="Given a web search question, retrieve the answer. Question: ",
                               document_instruction=""),
    "MedMCQA": ContrastiveSource("sentence-transformers/medmcqa", "question", "answer",
                                 query_instruction="Given a medical question, retrieve its explanation. "
                                                   "Question: ", document_instruction=""),
    "MSMARCO": ContrastiveSource("sentence-transformers/msmarco-bm25", "query", "positive", "negative",
                                 subset="triplet",
                                 query_instruction="Given a web search query, retrieve relevant passages that "
                                                   "answer the query. Query: ", document_instruction=""),
    "NPR": ContrastiveSource("sentence-transformers/npr", "title", "body",
                             query_instruction="Given a news headline, retrieve the article. Headline: ",
                             document_instruction=""),
    "PubMedQA": ContrastiveSource("sentence-transformers/pubmedqa", "question", "context",
                                  query_instruction="Given a biomedical question, retrieve the abstract that "
                                                    "answers it. Question: ", document_instruction=""),
    "QQP": ContrastiveSource("sentence-transformers/quora-duplicates", "anchor", "positive", "negative",
                             subset="triplet", query_instruction=_DUPLICATE),
    "SentenceCompression": ContrastiveSource("sentence-transformers/sentence-compression", "text", "simplified",
                                             query_instruction="Given a sentence, retrieve its compressed "
                                                               "version. Sentence: ", document_instruction=""),
    "StackExchange": ContrastiveSource("sentence-transformers/stackexchange-duplicates", "title1", "title2",
                                       subset="title-title-pair", query_instruction=_DUPLICATE),
    "StackOverflowDupQuestions": ContrastiveSource("mteb/stackoverflowdupquestions-reranking", "query",
                                                   "positive", "negative", query_instruction=_DUPLICATE),
    "STS12": ContrastiveSource("mteb/sts12-sts", "sentence1", "sentence2", score="score",
                               query_instruction=_SIMILAR),
    "STSBenchmark": ContrastiveSource("sentence-transformers/stsb", "sentence1", "sentence2", score="score",
                                      query_instruction=_SIMILAR),
    "TriviaQA": ContrastiveSource("sentence-transformers/trivia-qa", "query", "answer",
                                  query_instruction="Given a trivia question, retrieve passages that answer it. "
                                                    "Question: ", document_instruction=""),
    "WikiHow": ContrastiveSource("sentence-transformers/wikihow", "summary", "text",
                                 query_instruction="Given a summary, retrieve the WikiHow article. Summary: ",
                                 document_instruction=""),
    "YahooAnswers": ContrastiveSource("sentence-transformers/yahoo-answers", "title", "answer",
                                      subset="title-answer-pair",
                                      query_instruction="Given a question, retrieve the best answer. Question: ",
                                      document_instruction=""),
}


@dataclass
class ContrastiveDataConfig:
    # Registry names (CONTRASTIVE_DATASETS) and/or names of local-only data sets listed in local_files.
    datasets: List[str] = field(default_factory=lambda: list(CONTRASTIVE_DATASETS))
    local_files: Dict[str, str] = field(default_factory=dict)  # name -> local file, replaces the hub data set
    # name -> instruction for both sides (overrides the registry's; local-only data sets have none by default)
    instructions: Dict[str, str] = field(default_factory=dict)
    batch_size: int = 64  # per device; the negatives grow with the number of devices
    alpha: float = 0.5  # data sets are drawn with probability proportional to size**alpha
    use_hard_negatives: bool = True
    # Hard negatives per query, at most (null = all a data set has). A batch uses as many as each of its examples
    # has, so every device contributes the same number of candidates.
    max_hard_negatives: Optional[int] = None
    # No two examples of a global batch share a text (query, positive or negative): a repeated positive would be a
    # false in-batch negative. Off only to reproduce a sampler that allows them.
    no_duplicates: bool = True
    max_length: int = 512
    sts_min_score: float = 4.0
    max_examples_per_dataset: Optional[int] = None
    seed: int = 0
    num_workers: int = 0

    def validate(self, prefix: str = "data") -> None:
        require(bool(self.datasets), f"{prefix}.datasets", "is empty: name at least one contrastive data set")
        require(self.batch_size > 0, f"{prefix}.batch_size", "must be positive")
        require(self.alpha >= 0, f"{prefix}.alpha", "must be >= 0")
        require(self.max_length > 0, f"{prefix}.max_length", "must be positive")
        require(self.max_examples_per_dataset is None or self.max_examples_per_dataset > 0,
                f"{prefix}.max_examples_per_dataset", "must be positive or null")
        require(self.num_workers >= 0, f"{prefix}.num_workers", "must be >= 0")
        require(self.max_hard_negatives is None or self.max_hard_negatives >= 0, f"{prefix}.max_hard_negatives",
                "must be >= 0 or null (all)")


@dataclass
class ContrastiveLossConfig:
    temperature: float = 0.07
    # GradCache: embed the batch in chunks of this many texts without a graph, take the loss gradient on the
    # embeddings, then re-embed chunk by chunk with a graph. 0 = off (one ordinary forward/backward).
    grad_cache_chunk_size: int = 0
    # Matryoshka representation learning (Kusupati et al., 2022): the loss is the weighted sum of InfoNCE on the
    # first d dimensions of every embedding (re-normalised) for each d listed, e.g. [768, 512, 256, 128, 64], so a
    # truncated embedding still works. Empty = InfoNCE on the whole embedding only. Weights default to 1 each.
    matryoshka_dims: List[int] = field(default_factory=list)
    matryoshka_weights: Optional[List[float]] = None

    def validate(self, prefix: str = "loss") -> None:
        require(self.temperature > 0, f"{prefix}.temperature", "must be positive")
        require(self.grad_cache_chunk_size >= 0, f"{prefix}.grad_cache_chunk_size", "must be >= 0 (0 = off)")
        dims = list(self.matryoshka_dims)
        require(all(d > 0 for d in dims) and len(set(dims)) == len(dims), f"{prefix}.matryoshka_dims",
                f"must be distinct positive dimensions, got {dims}")
        weights = self.matryoshka_weights
        require(weights is None or (len(weights) == len(dims) and all(w > 0 for w in weights)),
                f"{prefix}.matryoshka_weights", f"must be {len(dims)} positive numbers, one per "
                f"{prefix}.matryoshka_dims entry (or null: 1 each), got {weights}")

    def dimension_weights(self, hidden_size: int) -> dict[int, float]:
        """{d: weight} of the loss: every Matryoshka dimension, or just the whole embedding."""
        if not self.matryoshka_dims:
            return {hidden_size: 1.0}
        too_large = [d for d in self.matryoshka_dims if d > hidden_size]
        require(not too_large, "loss.matryoshka_dims", f"{too_large} exceed the model's embedding size {hidden_size}")
        return dict(zip(self.matryoshka_dims, self.matryoshka_weights or [1.0] * len(self.matryoshka_dims)))


@dataclass
class ContrastiveConfig:
    model: str = "chandar-lab/NeoBERT"  # our checkpoint dir, any HF encoder dir or hub name, or preset:<name>
    tokenizer: Optional[str] = None
    # NeoBERTConfig fields the loaded model changes (NeoBERT models; other encoders run their own code): kernels,
    # eager | liger (Liger-Kernel's RMSNorm and SwiGLU on a GPU) | quack (QuACK's MLP on a GPU), neobert.model.kernels.
    model_overrides: Dict[str, Any] = field(default_factory=dict)
    data: ContrastiveDataConfig = field(default_factory=ContrastiveDataConfig)
    loss: ContrastiveLossConfig = field(default_factory=ContrastiveLossConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=2e-5, weight_decay=0.01, betas=[0.9, 0.999], eps=1e-8))
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(name="linear", warmup_steps=100))
    # Negatives grow with the devices (every device's documents are gathered); strategy "ddp" for several.
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        devices=1, max_steps=2000, precision="bf16-mixed", checkpoint_every_n_steps=500))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(loggers=["csv"]))
    # A local STS file (STS Benchmark layout) scored before and after training: the zero-shot vs tuned check.
    eval_sts: Optional[str] = None
    # Also score eval_sts on embeddings truncated to these sizes (re-normalised); empty = loss.matryoshka_dims.
    eval_sts_dims: List[int] = field(default_factory=list)
    output_dir: str = "runs/contrastive"
    resume: bool = False  # continue from output_dir's newest readable checkpoint: weights, optimizer, data position

    RENAMED_KEYS: ClassVar[Dict[str, str]] = {
        **{f"train.{key}": f"loss.{key}" for key in ("temperature", "grad_cache_chunk_size")},
        **{f"train.{key}": f"optimizer.{key}" for key in OPTIMIZER_KEYS},
        "train.warmup_steps": "scheduler.warmup_steps",
        "train.max_steps": "trainer.max_steps",
        "train.gradient_clip": "trainer.gradient_clip_val",
        **LOGGING_KEYS_MOVED,
        **KERNELS_MOVED,
    }

    def validate(self) -> None:
        """Checks the values the types cannot; every message names the key."""
        for section in (self.data, self.loss, self.optimizer, self.scheduler, self.trainer, self.logging):
            section.validate()
        check_optimizer_strategy(self.optimizer, self.trainer)
        check_load_time_overrides(self.model_overrides)
        # The linear decay needs the run's length.
        require(self.trainer.max_steps > 0, "trainer.max_steps", "must be positive")
        require(all(d > 0 for d in self.eval_sts_dims), "eval_sts_dims", "must be positive dimensions")
        require(not self.trainer.ema.decay, "trainer.ema", "is supported by pretraining only (experiments.pretrain)")
        # GradCache steps the optimizer itself, once per batch: Lightning cannot accumulate for it.
        require(self.loss.grad_cache_chunk_size == 0 or self.trainer.accumulate_grad_batches == 1,
                "trainer.accumulate_grad_batches", "must be 1 with GradCache (loss.grad_cache_chunk_size > 0)")
