"""The ladder runner end to end on a minute-sized ladder (M2 and its tokenizer branch M3 at two seeds), offline,
with the built-in GLUE fallback (as on a fresh clone) and a small STS file, then the notebook executed on its
output (nbclient)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from neobert.data.demo_corpus import write_demo_corpus, write_fallback_glue
from neobert.eval.probes import embedding_similarities, fill_mask

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


MINI = ("max_steps=3", "glue.max_train_steps=2", "glue.max_train_examples=32", "glue.max_eval_examples=32",
        "bpe_vocab_size=600", "seeds=[0,1]", "sts.finetune_steps=3")


def write_sts_files(directory: Path, pairs: int = 48) -> Path:
    """A small STS Benchmark-layout train/dev pair from the demo corpus: a sentence with itself scores 5, two
    unrelated sentences 0 to 2."""
    from neobert.data.demo_corpus import demo_documents

    sentences = [" ".join(d["content"].split())[:80] for d in demo_documents()[: 2 * pairs]]
    directory.mkdir(parents=True)
    for name, offset in (("sts-train.csv", 0), ("sts-dev.csv", pairs)):
        lines = []
        for i in range(offset, offset + pairs):
            same = i % 2 == 0
            other = sentences[i] if same else sentences[(i + 7) % len(sentences)]
            score = 5.0 if same else float(i % 3)
            lines.append(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{score}\t{sentences[i]}\t{other}")
        (directory / name).write_text("\n".join(lines) + "\n")
    return directory


def run_mini_ladder(out: Path, *extra: str):
    from experiments.ablations import main

    return main(["--steps", "m02,m03", "--budget", "tiny", "--output-dir", str(out),
                 *[f"--budget-override={o}" for o in (*MINI, f"sts.data_dir={out.parent / 'sts'}", *extra)],
                 "logging.log_every_n_steps=1"])


@pytest.fixture(scope="module")
def mini_ladder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ladder")
    out = root / "out"
    write_sts_files(root / "sts")
    old = os.environ.get("NEOBERT_SHARED_DATA")
    os.environ["NEOBERT_SHARED_DATA"] = str(root / "no-shared-data")  # as on a fresh clone: the fallback task
    try:
        run_mini_ladder(out)
    finally:
        if old is None:
            os.environ.pop("NEOBERT_SHARED_DATA")
        else:
            os.environ["NEOBERT_SHARED_DATA"] = old
    return out


def test_runner_writes_results_for_every_step_and_seed(mini_ladder):
    rows = json.loads((mini_ladder / "results.json").read_text())
    # seed by seed: the whole ladder at the first seed comes first
    assert [(r["step"], r["seed"]) for r in rows] == [("m02", 0), ("m03", 0), ("m02", 1), ("m03", 1)]
    m02, m03 = rows[:2]
    assert m03["parent"] == "m02" and m03["carried_forward"] is False
    assert list(m03["effective_changes"]) == ["data.tokenizer"]
    for row in rows:
        assert Path(row["export_dir"]) == mini_ladder / row["step"] / f"seed{row['seed']}" / "export"
        assert (Path(row["export_dir"]) / "model.safetensors").is_file()
        assert 0.0 <= row["glue_score"] <= 1.0 and set(row["glue"]) == {"rte"}
        assert row["train_loss"] is not None and row["parameters"] > 0
        assert row["heldout_loss"] > 0 and 0 <= row["heldout_accuracy"] <= 1 and row["pseudo_perplexity"] > 1
        assert -1 <= row["sts_zero_shot"] <= 1 and -1 <= row["sts_tuned"] <= 1
        assert any("fallback pair task" in n for n in row["notes"])
    # the seeds are different runs (initialisation, masks, data order), scored on the same documents
    assert rows[0]["heldout_loss"] != rows[2]["heldout_loss"]
    assert m02["tokenizer"] == "bert-base-uncased" and m03["tokenizer"] == "bpe-600"
    # the tokenizer step trained its own BPE offline and says so; its model's vocabulary follows it
    assert any("BPE" in n for n in m03["notes"])
    config = json.loads((Path(m03["export_dir"]) / "config.json").read_text())
    assert config["vocab_size"] < 1000 and (mini_ladder / "tokenizers" / "bpe-600" / "tokenizer.json").is_file()
    table = (mini_ladder / "results.md").read_text()
    assert "| M02 |" in table and "| M03 |" in table and "GLUE score" in table and "± " in table
    assert "not comparable (tokenizer)" in table  # M3's loss is over other units
    for metric in ("heldout_loss", "pseudo_perplexity", "sts_zero_shot", "sts_tuned", "glue_score"):
        assert (mini_ladder / f"figure1_{metric}.png").read_bytes()[:4] == b"\x89PNG"


def test_the_heldout_documents_are_kept_out_of_training(mini_ladder):
    corpora = mini_ladder / "corpora"
    heldout = (corpora / "heldout.jsonl").read_text().splitlines()
    train = (corpora / "demo.train.jsonl").read_text().splitlines()
    assert len(heldout) == 64 and not set(heldout) & set(train)
    assert heldout + train == (corpora / "demo.jsonl").read_text().splitlines()
    rows = json.loads((mini_ladder / "results.json").read_text())
    assert {r["data_source"] for r in rows} == {str(corpora / "demo.train.jsonl")}


def test_a_rerun_reads_finished_runs_back_and_rescores_a_changed_protocol(mini_ladder, monkeypatch):
    monkeypatch.setenv("NEOBERT_SHARED_DATA", str(mini_ladder.parent / "no-shared-data"))  # as the fixture ran
    before = json.loads((mini_ladder / "results.json").read_text())
    weights = {r["export_dir"]: (Path(r["export_dir"]) / "model.safetensors").stat().st_mtime_ns for r in before}
    run_mini_ladder(mini_ladder)  # the same command again: nothing is retrained or rescored
    assert json.loads((mini_ladder / "results.json").read_text()) == before
    # a changed evaluation protocol rescores the same checkpoints
    run_mini_ladder(mini_ladder, "heldout.mask_rate=0.3", "sts.data_dir=null", "glue.tasks=[]")
    after = json.loads((mini_ladder / "results.json").read_text())
    for old, new in zip(before, after):
        assert (Path(new["export_dir"]) / "model.safetensors").stat().st_mtime_ns == weights[new["export_dir"]]
        assert new["heldout_loss"] != old["heldout_loss"] and new["protocol"]["heldout"]["mask_rate"] == 0.3
        assert new["sts_tuned"] is None and new["glue_score"] is None
        assert new["pretrain_seconds"] == old["pretrain_seconds"] > 0  # the training time is kept
    run_mini_ladder(mini_ladder)  # back to the fixture's protocol for the tests that follow
    assert [r["heldout_loss"] for r in json.loads((mini_ladder / "results.json").read_text())] == \
        [r["heldout_loss"] for r in before]


def test_fallback_glue_task_layout(tmp_path):
    from neobert.data.glue import get_task, load_glue_split

    corpus = write_demo_corpus(tmp_path / "corpus.jsonl")
    root = write_fallback_glue(corpus, tmp_path / "glue", train=40, validation=20)
    train = load_glue_split(get_task("rte"), "train", root)
    assert len(train) == 40 and set(train["label"]) == {0, 1}


def test_probes_on_a_checkpoint(mini_ladder):
    export = mini_ladder / "m02" / "seed0" / "export"
    predictions = fill_mask(export, "The [MASK] statement defines a function.", top_k=3)
    assert len(predictions) == 1 and len(predictions[0]) == 3
    assert all(0 <= p <= 1 for _, p in predictions[0])
    sims = embedding_similarities(export, ["a b c", "a b c", "something else entirely"])
    assert sims.shape == (3, 3) and abs(sims[0, 1] - 1) < 1e-5


def test_notebook_executes_on_the_ladder_output(mini_ladder, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    figures = tmp_path / "figures"
    notebook = nbformat.read(REPO / "notebooks" / "ablations.ipynb", as_version=4)
    env = {"NEOBERT_ABLATION_DIR": str(mini_ladder), "NEOBERT_FIGURE_DIR": str(figures),
           "NEOBERT_THROUGHPUT_CSV": str(tmp_path / "none.csv")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    figure1 = [f"figure1_{m}" for m in ("heldout_loss", "pseudo_perplexity", "sts_zero_shot", "sts_tuned",
                                         "glue_score")]
    for name in (*figure1, "figure2_pseudo_perplexity", "figure3_throughput"):
        assert (figures / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(o.output_type == "display_data" and "image/png" in o.data for o in outputs) == len(figure1) + 2
    shown = "".join(str(o.get("data", {}).get("text/html", "")) + str(o.get("data", {}).get("text/markdown", ""))
                    + str(o.get("text", "")) for o in outputs)
    assert "| m02 |" in shown and "| m03 |" in shown  # Figure 2's table, one run per step
    assert "paraphrase" in shown and "gap" in shown  # the probe table across steps
    if os.environ.get("NEOBERT_NOTEBOOK_OUT"):  # keep the executed notebook (docs)
        nbformat.write(notebook, os.environ["NEOBERT_NOTEBOOK_OUT"])
