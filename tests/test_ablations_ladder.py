"""The ladder runner end to end on a minute-sized ladder (M0 and the tokenizer branch M3), offline, with the
built-in GLUE fallback (as on a fresh clone), then the notebook executed on its output (nbclient)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from neobert.data.demo_corpus import write_demo_corpus, write_fallback_glue
from neobert.eval.probes import embedding_similarities, fill_mask

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mini_ladder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder")
    old = os.environ.get("NEOBERT_SHARED_DATA")
    os.environ["NEOBERT_SHARED_DATA"] = str(out / "no-shared-data")  # as on a fresh clone: the fallback task
    try:
        from experiments.ablations import main

        main(["--steps", "m00,m03", "--budget", "tiny", "--output-dir", str(out),
              *[f"--budget-override={o}" for o in ("max_steps=3", "glue.max_train_steps=2",
                                                    "glue.max_train_examples=32", "glue.max_eval_examples=32",
                                                    "bpe_vocab_size=600")],
              "logging.log_every_n_steps=1"])
    finally:
        if old is None:
            os.environ.pop("NEOBERT_SHARED_DATA")
        else:
            os.environ["NEOBERT_SHARED_DATA"] = old
    return out


def test_runner_writes_results_for_every_step(mini_ladder):
    rows = json.loads((mini_ladder / "results.json").read_text())
    assert [r["step"] for r in rows] == ["m00", "m03"]
    m00, m03 = rows
    assert m03["parent"] == "m02" and m03["carried_forward"] is False
    assert list(m03["effective_changes"]) == ["data.tokenizer"]
    for row in rows:
        assert (Path(row["export_dir"]) / "model.safetensors").is_file()
        assert 0.0 <= row["glue_score"] <= 1.0 and set(row["glue"]) == {"rte"}
        assert row["train_loss"] is not None and row["parameters"] > 0
        assert any("fallback pair task" in n for n in row["notes"])
    # the tokenizer step trained its own BPE offline and says so; its model's vocabulary follows it
    assert any("BPE" in n for n in m03["notes"])
    config = json.loads((Path(m03["export_dir"]) / "config.json").read_text())
    assert config["vocab_size"] < 1000 and (mini_ladder / "tokenizers" / "bpe-600" / "tokenizer.json").is_file()
    table = (mini_ladder / "results.md").read_text()
    assert "| M00 |" in table and "| M03 |" in table and "GLUE subset" in table
    assert (mini_ladder / "glue_per_step.png").read_bytes()[:4] == b"\x89PNG"


def test_fallback_glue_task_layout(tmp_path):
    from neobert.data.glue import get_task, load_glue_split

    corpus = write_demo_corpus(tmp_path / "corpus.jsonl")
    root = write_fallback_glue(corpus, tmp_path / "glue", train=40, validation=20)
    train = load_glue_split(get_task("rte"), "train", root)
    assert len(train) == 40 and set(train["label"]) == {0, 1}


def test_probes_on_a_checkpoint(mini_ladder):
    export = mini_ladder / "m00" / "export"
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
    for name in ("figure1_glue_per_step", "figure2_pseudo_perplexity", "figure3_throughput"):
        assert (figures / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(o.output_type == "display_data" and "image/png" in o.data for o in outputs) >= 3
    if os.environ.get("NEOBERT_NOTEBOOK_OUT"):  # keep the executed notebook (docs)
        nbformat.write(notebook, os.environ["NEOBERT_NOTEBOOK_OUT"])
