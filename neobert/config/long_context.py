"""The schema of the long-context retrieval measurement (`python -m experiments.long_context --model <...>`;
LongEmbed's synthetic passkey and needle tasks, generated offline; docs/contrastive_mteb.md, section 5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from neobert.config.loader import require

LONG_CONTEXT_TASKS = ("passkey", "needle")
# LongEmbed's lengths up to 4,096 (it goes on to 32,768); the default keeps those that fit each model.
STANDARD_LENGTHS = (256, 512, 1024, 2048, 4096)
# The distinct hidden sentences of each task (neobert.data.long_context: 25 first x 20 last names; 25 cities x 4
# facts), so the most documents (= queries) one length can have.
MAX_EXAMPLES_PER_LENGTH = {"passkey": 500, "needle": 100}


@dataclass
class LongContextConfig:
    # Models to evaluate, each a path, hub name or preset:<name>, optionally labelled `label=path`; one curve per
    # model and task.
    models: List[str] = field(default_factory=list)
    tokenizer: Optional[str] = None  # default: beside each model's weights
    tasks: List[str] = field(default_factory=lambda: list(LONG_CONTEXT_TASKS))
    # Document lengths in the model tokenizer's tokens, special tokens included. null = 256, 512, ..., 4096 up to
    # each model's max_length; a length given here beyond a model's max_length is refused (never truncated).
    lengths: Optional[List[int]] = None
    examples_per_length: int = 100  # documents (= queries) per task and length: the candidates of each query
    seed: int = 0
    length_tolerance: int = 16  # a document has between length - tolerance and length tokens
    # JSON {"query": {task: text}, "document": {task: text}} keyed by LongContextPasskey / LongContextNeedle;
    # the packaged file has neither, so the default evaluates raw texts, as LongEmbed does.
    instructions: str = "none"
    batch_size: int = 8
    device: Optional[str] = None  # default: cuda if available
    dtype: Optional[str] = None  # float32 | bfloat16; null = bfloat16 on GPU, float32 on CPU (as experiments.mteb)
    output_dir: str = "runs/long_context"

    def validate(self) -> None:
        require(bool(self.models), "models", "give at least one model: --model <export dir / HF dir / preset:name>")
        unknown = [t for t in self.tasks if t not in LONG_CONTEXT_TASKS]
        require(bool(self.tasks) and not unknown, "tasks",
                f"must be some of {list(LONG_CONTEXT_TASKS)}, got {self.tasks}")
        require(self.lengths is None or (bool(self.lengths) and all(n > 0 for n in self.lengths)), "lengths",
                f"must be positive token counts or null, got {self.lengths}")
        require(self.examples_per_length >= 2, "examples_per_length", "must be at least 2 (the candidates)")
        for task in sorted(set(self.tasks), key=MAX_EXAMPLES_PER_LENGTH.get):
            most = MAX_EXAMPLES_PER_LENGTH[task]
            require(self.examples_per_length <= most, "examples_per_length",
                    f"the {task} task has {most} distinct hidden sentences, so at most {most} documents per length; "
                    f"got {self.examples_per_length}")
        require(0 <= self.length_tolerance, "length_tolerance", "must be >= 0")
        require(self.batch_size > 0, "batch_size", "must be positive")
        require(self.dtype in (None, "float32", "bfloat16"), "dtype",
                f"must be float32, bfloat16 or null, got {self.dtype!r}")
