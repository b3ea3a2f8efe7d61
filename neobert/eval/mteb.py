"""MTEB measurements on mteb v2 (`mteb.evaluate`) for any of our checkpoints or any Hugging Face encoder, with the
paper's per-task instructions actually applied (paper Section 5.2, Table 4; the released code wrote them and never
used them).

* `MtebEncoder`: mteb's encoder protocol around a `Backbone`: instruction prefix per task and side (queries;
  documents for retrieval/reranking), length-sorted batches, masked mean pooling, bf16 autocast on GPU, and
  optionally Matryoshka truncation to the first `dim` dimensions.
* `LocalSTSTask` / `LocalRetrievalTask` / `LocalBeirTask`: tasks read from local files (tests, firewalled machines);
  `SplitsRetrievalTask`: a retrieval task over data made in memory, one split per part (the long-context tasks).
* `score_tasks`: each task's scores; the run that writes them with the paper's Table 4 summary is
  `neobert.jobs.mteb.run_mteb`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mteb
import torch
from datasets import Dataset, DatasetDict
from mteb.abstasks import AbsTaskRetrieval, AbsTaskSTS
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta
from torch import Tensor

from neobert.config import ConfigError, config_path
from neobert.data.backbone import Backbone
from neobert.data.beir import read_beir
from neobert.data.contrastive import prepend_instruction, read_local_examples, read_sts_pairs
from neobert.errors import DataError
from neobert.eval.flops import warn_if_bf16_is_emulated
from neobert.hub import require_hub
from neobert.layout import MATRYOSHKA_JSON, SENTENCE_BERT_CONFIG
from neobert.model.heads import pool_embeddings

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS = config_path("mteb_instructions.json")
ENGLISH_BENCHMARK = "MTEB(eng, v1)"  # the 56 English tasks of the paper's Table 4


# ----------------------------------------------------------------------------------------------- instructions


@dataclass
class TaskInstructions:
    """Per-task instruction prefixes: `query` for queries and symmetric tasks, `document` for the documents of
    retrieval and reranking tasks. A task absent from the file gets no instruction (logged once)."""

    query: dict[str, str] = field(default_factory=dict)
    document: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None) -> "TaskInstructions":
        """`path` = a JSON file {"query": {task: text}, "document": {task: text}}; None or "none" = no instructions."""
        if path is None or str(path).lower() == "none":
            return cls()
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"instruction file {str(path)!r} does not exist (config key `instructions`; "
                                    f"'none' evaluates without instructions)")
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data.get("query"), dict):
            raise DataError(f"{path}: expected {{'query': {{task: instruction}}, 'document': {{...}}}}")
        return cls(dict(data["query"]), dict(data.get("document", {})))

    def for_task(self, task_name: str, prompt_type: Any = None) -> str:
        is_document = str(getattr(prompt_type, "value", prompt_type)) == "document"
        if is_document and task_name in self.document:
            return self.document[task_name]
        return self.query.get(task_name, "")


# ----------------------------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class LengthLimit:
    """The tokens each text is truncated to, and where that number comes from (shown in the summary)."""

    tokens: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "source": self.source}


_NO_LIMIT = 1_000_000  # tokenizers without a limit say 1e30


def model_length_limit(backbone: Backbone) -> LengthLimit:
    """The model's own truncation length, what its authors evaluate it with: a sentence-transformers directory's
    `max_seq_length` (sentence_bert_config.json: 256 for all-MiniLM-L6-v2, whose position table holds 512),
    else NeoBERT's `max_length` (config.json), else the smaller of a Hugging Face encoder's position table
    (`max_position_embeddings`) and its tokenizer's `model_max_length` (when the tokenizer names one: RoBERTa's
    table holds 514 rows for 512 tokens). A `max_seq_length` beyond what the model can read is cut to that, saying
    so. (A Hugging Face config's own `max_length` is a generation default, not an input limit, and is not read.)"""
    config = backbone.encoder.config
    if backbone.is_neobert:
        readable = LengthLimit(int(config.max_length), "the NeoBERT config's max_length")
    else:
        candidates = [LengthLimit(int(n), source) for n, source in (
            (getattr(config, "max_position_embeddings", None), "the model config's max_position_embeddings"),
            (getattr(backbone.tokenizer, "model_max_length", None), "the tokenizer's model_max_length"))
            if n is not None and 0 < n < _NO_LIMIT]
        readable = min(candidates, key=lambda limit: limit.tokens) if candidates else None
    st_config = Path(backbone.source) / SENTENCE_BERT_CONFIG if backbone.source else None
    st_length = (json.loads(st_config.read_text()).get("max_seq_length")
                 if st_config is not None and st_config.is_file() else None)
    if st_length:
        st = LengthLimit(int(st_length), f"sentence-transformers' max_seq_length ({SENTENCE_BERT_CONFIG})")
        if readable is None or st.tokens <= readable.tokens:
            return st
        return LengthLimit(readable.tokens, f"{readable.source} ({SENTENCE_BERT_CONFIG} says {st.tokens}, more "
                                            f"than the model reads)")
    if readable is None:
        raise ConfigError(f"cannot tell how many tokens {type(backbone.encoder).__name__} reads (no "
                          f"{SENTENCE_BERT_CONFIG}, position table or tokenizer limit): set max_length")
    return readable


def resolve_length_limit(backbone: Backbone, max_length: int | None, key: str = "max_length") -> LengthLimit:
    """`max_length` when one is set (the config key `key`), else the model's own limit (`model_length_limit`);
    the source of a set one names the model's own limit beside it, and one above it is warned about (whichever job
    set it: MTEB, its callback during pretraining, contrastive STS scoring, mining)."""
    if max_length is None:
        return model_length_limit(backbone)
    try:
        own = model_length_limit(backbone)
    except ConfigError:
        return LengthLimit(int(max_length), f"{key}={max_length}, set in the config")
    if max_length > own.tokens:
        log.warning("%s=%d is more than the model's own limit, %d tokens: texts are read further than its authors "
                    "evaluate it (null = the model's own limit)", key, max_length, own.tokens)
    return LengthLimit(int(max_length), f"{key}={max_length}, set in the config (the model's own limit: "
                                        f"{own.tokens}, {own.source})")


@torch.inference_mode()
def embed_texts(backbone: Backbone, texts: Sequence[str], batch_size: int = 64, max_length: int | None = None,
                device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Masked-mean-pooled embeddings [N, hidden] (float32, on CPU) in the order of `texts`, each text truncated to
    `max_length` tokens (None: the model's own limit, `model_length_limit`). Texts are batched by token length
    (less padding), and autocast to `dtype` when one is given (bf16 on GPU)."""
    if not texts:
        return torch.empty(0, backbone.hidden_size)
    device = torch.device(device) if device is not None else next(backbone.parameters()).device
    tokenizer = backbone.tokenizer
    max_length = max_length or model_length_limit(backbone).tokens
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length, return_token_type_ids=False)
    order = sorted(range(len(texts)), key=lambda i: len(encoded["input_ids"][i]), reverse=True)
    output = torch.empty(len(texts), backbone.hidden_size)
    was_training = backbone.training
    backbone.eval()
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        batch = tokenizer.pad({"input_ids": [encoded["input_ids"][i] for i in index]}, return_tensors="pt")
        input_ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            hidden = backbone(input_ids, mask)
        output[index] = pool_embeddings(hidden.float(), mask, "mean").cpu()
    backbone.train(was_training)
    return output


def truncate_embeddings(embeddings: Tensor, dim: int | None) -> Tensor:
    """The first `dim` dimensions of each embedding, re-normalised to unit length (a Matryoshka truncation);
    None = unchanged."""
    if dim is None:
        return embeddings
    if not 0 < dim <= embeddings.shape[-1]:
        raise ConfigError(f"dim={dim}: must be between 1 and the embedding size {embeddings.shape[-1]}")
    return torch.nn.functional.normalize(embeddings[:, :dim], dim=-1)


def trained_dims(model: str | Path) -> list[int] | None:
    """The embedding sizes a contrastive export was trained for (its matryoshka.json), None when it has none."""
    path = Path(model) / MATRYOSHKA_JSON
    return json.loads(path.read_text())["dims"] if path.is_file() else None


class MtebEncoder(AbsEncoder):
    """mteb v2 encoder protocol for a `Backbone` (ours or any Hugging Face encoder):
    `MtebEncoder(load_backbone("runs/contrastive/export"), TaskInstructions.load(DEFAULT_INSTRUCTIONS))`.
    `dim` evaluates embeddings truncated to their first `dim` dimensions (re-normalised); encoders of one model
    at several truncations can share a `cache` (text -> whole embedding) so each text is embedded once. Texts are
    truncated to `max_length` tokens, by default the model's own limit (`model_length_limit`: 256 for
    all-MiniLM-L6-v2, as sentence-transformers and MTEB's published scores use); `max_length_key` names the config
    key an explicit `max_length` came from."""

    def __init__(self, backbone: Backbone, instructions: TaskInstructions | None = None, batch_size: int = 64,
                 max_length: int | None = None, device: str | None = None, dtype: torch.dtype | None = None,
                 name: str = "neobert-suite/encoder", revision: str = "local", dim: int | None = None,
                 cache: dict[str, Tensor] | None = None, max_length_key: str = "max_length"):
        if dim is not None and not 0 < dim <= backbone.hidden_size:
            raise ConfigError(f"dim={dim}: must be between 1 and the model's embedding size {backbone.hidden_size}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = backbone.to(self.device)
        self.dim = dim
        self.cache = cache  # text -> whole embedding, shared by encoders of one model at several truncations
        self.instructions = instructions or TaskInstructions()
        self.batch_size = batch_size
        # The truncation of every text: `max_length` when given, else the model's own limit (in the report).
        self.length_limit = resolve_length_limit(backbone, max_length, max_length_key)
        self.max_length = self.length_limit.tokens
        # bf16 on GPU (paper protocol); fp32 on CPU unless asked (bf16 is faster where the CPU has avx512_bf16).
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else None)
        if self.dtype == torch.float32:
            self.dtype = None  # no autocast
        warn_if_bf16_is_emulated(self.device.type, self.dtype)
        self.mteb_model_meta = ModelMeta.create_empty(overwrites={"name": name, "revision": revision})
        self._missing_logged: set[str] = set()

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs):
        instruction = self.instructions.for_task(task_metadata.name, prompt_type)
        if not instruction and task_metadata.name not in self._missing_logged:
            self._missing_logged.add(task_metadata.name)
            log.info("no instruction for task %s (%s): texts are encoded as they are", task_metadata.name,
                     prompt_type)
        texts = [prepend_instruction(instruction, text) for batch in inputs for text in batch["text"]]
        batch_size = kwargs.get("batch_size") or self.batch_size
        if self.cache is None:
            embeddings = embed_texts(self.model, texts, batch_size, self.max_length, self.device, self.dtype)
        else:  # embed only what no earlier call (e.g. at another truncation) has embedded
            missing = list(dict.fromkeys(t for t in texts if t not in self.cache))
            new = embed_texts(self.model, missing, batch_size, self.max_length, self.device, self.dtype)
            self.cache.update(zip(missing, new))
            embeddings = torch.stack([self.cache[t] for t in texts]) if texts else new
        return truncate_embeddings(embeddings, self.dim).numpy()


# ----------------------------------------------------------------------------------------------- local tasks


class _LocalTaskMixin:
    """mteb declares `metadata` per class and drops instance copies when it unloads data; local tasks are named
    per instance (one per file), so their metadata lives behind a property."""

    @property
    def metadata(self):
        return self._local_metadata

    @metadata.setter
    def metadata(self, value) -> None:
        self._local_metadata = value


def _metadata(name: str, task_type: str, main_score: str, path: Path, split: str):
    return TaskMetadata(name=name, description=f"Local {task_type} task read from {path}", type=task_type,
                        main_score=main_score, dataset={"path": str(path), "revision": "local"},
                        eval_langs=["eng-Latn"], eval_splits=[split], reference=None, category="t2t",
                        modalities=["text"])


class LocalSTSTask(_LocalTaskMixin, AbsTaskSTS):
    """STS from an STS Benchmark release CSV (or sentence1/sentence2/score table); main score cosine Spearman."""

    min_score, max_score = 0, 5

    def __init__(self, path: str | Path, name: str | None = None, split: str = "test",
                 max_examples: int | None = None, **kwargs):
        self.path, self.split, self.max_examples = Path(path), split, max_examples
        if not self.path.is_file():
            raise FileNotFoundError(f"local STS file {str(self.path)!r} does not exist")
        self.metadata = _metadata(name or f"LocalSTS-{self.path.stem}", "STS", "cosine_spearman", self.path, split)
        super().__init__(**kwargs)

    def load_data(self, **kwargs) -> None:
        if self.data_loaded:
            return
        pairs = read_sts_pairs(self.path)[: self.max_examples]
        self.dataset = DatasetDict({self.split: Dataset.from_dict({
            "sentence1": [a for a, _, _ in pairs], "sentence2": [b for _, b, _ in pairs],
            "score": [s for _, _, s in pairs]})})
        self.data_loaded = True


def retrieval_split(queries: dict[str, str], corpus: dict[str, str | tuple[str, str]],
                    qrels: dict[str, dict[str, int]]) -> RetrievalSplitData:
    """mteb's data of one retrieval split: queries {id: text}, corpus {id: text or (title, text)} (mteb embeds a
    document as "title text"), qrels {query id: {document id: score}}."""
    documents = {"id": list(corpus), "text": [d[1] if isinstance(d, tuple) else d for d in corpus.values()]}
    if any(isinstance(d, tuple) for d in corpus.values()):
        documents["title"] = [d[0] if isinstance(d, tuple) else "" for d in corpus.values()]
    return RetrievalSplitData(queries=Dataset.from_dict({"id": list(queries), "text": list(queries.values())}),
                              corpus=Dataset.from_dict(documents), relevant_docs=qrels, top_ranked=None)


class LocalRetrievalTask(_LocalTaskMixin, AbsTaskRetrieval):
    """Retrieval from a jsonl of (query, positive[, negatives]) examples (the contrastive layouts): the corpus is
    every positive and hard negative, each query's relevant document its positive; main score nDCG@10."""

    def __init__(self, path: str | Path, name: str | None = None, split: str = "test",
                 max_examples: int | None = None, **kwargs):
        self.path, self.split, self.max_examples = Path(path), split, max_examples
        if not self.path.is_file():
            raise FileNotFoundError(f"local retrieval file {str(self.path)!r} does not exist")
        self.metadata = _metadata(name or f"LocalRetrieval-{self.path.stem}", "Retrieval", "ndcg_at_10",
                                  self.path, split)
        super().__init__(**kwargs)

    def load_data(self, **kwargs) -> None:
        if self.data_loaded:
            return
        examples = read_local_examples(self.path)[: self.max_examples]
        documents: dict[str, str] = {}  # text -> id, so a repeated document is one corpus entry

        def doc_id(text: str) -> str:
            return documents.setdefault(text, f"d{len(documents)}")

        queries, relevant = {}, {}
        for number, example in enumerate(examples):
            query_id = f"q{number}"
            queries[query_id] = example.query
            relevant[query_id] = {doc_id(example.positive): 1}
            for negative in example.negatives:
                doc_id(negative)
        corpus = {doc: text for text, doc in documents.items()}
        self.dataset = {"default": {self.split: retrieval_split(queries, corpus, relevant)}}
        self.data_loaded = True


class LocalBeirTask(_LocalTaskMixin, AbsTaskRetrieval):
    """Retrieval from a directory in the BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv; read and
    checked by `neobert.data.beir`), scored by mteb: main score nDCG@10 (graded relevance, as mteb computes it for
    hub tasks), MRR@10 and recall@100 among the scores. The split is `split`, else the only qrels file. A task
    named after an mteb task (`beir:SciFact=<dir>`) gets that task's instructions."""

    def __init__(self, path: str | Path, name: str | None = None, split: str | None = None,
                 max_examples: int | None = None, **kwargs):
        self.path, self.max_examples = Path(path), max_examples
        self.data = read_beir(self.path, split)  # here, so a bad directory fails before the model is loaded
        self.split = self.data.split
        self.metadata = _metadata(name or f"LocalBEIR-{self.path.resolve().name}", "Retrieval", "ndcg_at_10",
                                  self.path, self.split)
        super().__init__(**kwargs)

    def load_data(self, **kwargs) -> None:
        if self.data_loaded:
            return
        query_ids = list(self.data.queries)[: self.max_examples]
        queries = {q: self.data.queries[q] for q in query_ids}
        qrels = {q: self.data.qrels[q] for q in query_ids}
        self.dataset = {"default": {self.split: retrieval_split(queries, self.data.corpus, qrels)}}
        self.data_loaded = True


class SplitsRetrievalTask(_LocalTaskMixin, AbsTaskRetrieval):
    """A retrieval task over data made in memory, one split per part, each split its own corpus (LongEmbed's
    layout: `test_256`, `test_512`, ... with the documents of that length as the candidates); `splits` maps a split
    name to (queries, corpus, qrels) as `retrieval_split` takes them."""

    def __init__(self, name: str, splits: dict[str, tuple[dict, dict, dict]], main_score: str = "ndcg_at_1",
                 description: str = "", **kwargs):
        if not splits:
            raise ValueError(f"{name}: no splits")
        self.splits = splits
        self.metadata = TaskMetadata(name=name, description=description or f"Local retrieval task {name}",
                                     type="Retrieval", main_score=main_score,
                                     dataset={"path": name, "revision": "local"}, eval_langs=["eng-Latn"],
                                     eval_splits=list(splits), reference=None, category="t2t", modalities=["text"])
        super().__init__(**kwargs)

    def load_data(self, **kwargs) -> None:
        if self.data_loaded:
            return
        self.dataset = {"default": {split: retrieval_split(*parts) for split, parts in self.splits.items()}}
        self.data_loaded = True


LOCAL_TASKS = {"sts": LocalSTSTask, "retrieval": LocalRetrievalTask, "beir": LocalBeirTask}
LOCAL_SPECS = "'sts:<file>', 'retrieval:<file>', 'beir:<directory>'"


def local_task(kind: str, path: str | Path, name: str | None = None, max_examples: int | None = None,
               beir_split: str | None = None):
    """The local task of a spec `<kind>:[<name>=]<path>` (kind sts, retrieval or beir)."""
    if kind == "beir":
        return LocalBeirTask(path, name=name, split=beir_split, max_examples=max_examples)
    return LOCAL_TASKS[kind](path, name=name, max_examples=max_examples)


def resolve_tasks(specs: Sequence[str], max_examples: int | None = None, beir_split: str | None = None) -> list:
    """Task specs: mteb task names, `english` (the paper's 56 English tasks, MTEB(eng, v1)), or local tasks
    `sts:<file>` / `retrieval:<file>` / `beir:<directory>` (optionally `sts:<name>=<file>`); `beir_split` picks
    the qrels split of BEIR directories (default: their only one)."""
    tasks, names = [], []
    for spec in specs:
        kind, _, rest = spec.partition(":")
        if rest and kind in LOCAL_TASKS:
            name, _, path = rest.rpartition("=") if "=" in rest else (None, "", rest)
            tasks.append(local_task(kind, path, name or None, max_examples, beir_split))
        elif spec.lower() == "english":
            tasks.extend(mteb.get_benchmark(ENGLISH_BENCHMARK).tasks)
        else:
            names.append(spec)
    if names:
        try:
            tasks.extend(mteb.get_tasks(tasks=names, languages=["eng"]))
        except KeyError as err:
            raise ConfigError(f"tasks: unknown MTEB task in {names} ({err.args[0]}); use mteb task names, 'english', or "
                             f"local tasks {LOCAL_SPECS}") from err
    if not tasks:
        raise ConfigError("tasks: no MTEB tasks given")
    for task in tasks:
        _require_task_data(task)
    return tasks


# ----------------------------------------------------------------------------------------------- scoring


def score_tasks(encoder, tasks: Sequence, batch_size: int = 64,
                show_progress_bar: bool = True) -> dict[str, dict[str, Any]]:
    """Evaluates `encoder` (any mteb encoder) on `tasks` (data sets come from the hub unless the tasks are local):
    {task name: {"type", "main_score", "scores"}}."""
    result = mteb.evaluate(encoder, list(tasks), cache=None, encode_kwargs={"batch_size": batch_size},
                           show_progress_bar=show_progress_bar, overwrite_strategy="always")
    types = {task.metadata.name: task.metadata.type for task in tasks}
    per_task = {}
    for task_result in result.task_results:
        per_task[task_result.task_name] = {
            "type": types.get(task_result.task_name, "unknown"),
            "main_score": float(task_result.get_score()),
            "scores": task_result.to_dict()["scores"],
        }
    return per_task


def _require_task_data(task) -> None:
    """Hub tasks need the hub: fail in seconds, naming the way out, instead of after the datasets' retries."""
    if isinstance(task, _LocalTaskMixin):
        return
    require_hub(f"MTEB task {task.metadata.name} ({task.metadata.dataset['path']}); local tasks are "
                f"{LOCAL_SPECS}", "tasks")
