"""The ablation ladder's configs: each step differs from its parent only in its documented keys."""

from __future__ import annotations

import warnings

import pytest

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import PretrainConfig
from neobert.jobs import ablation_eval, ablation_ladder as ab
from neobert.jobs.ablations import prepare_corpora
from neobert.model.config import NeoBERTConfig

CHILDREN = [s for s in ab.LADDER if s.parent]


def test_ladder_shape_matches_the_paper():
    assert [s.step for s in ab.LADDER] == [f"m{i:02d}" for i in range(11)]
    reverted = {s.step for s in ab.LADDER if not s.carried_forward}
    assert reverted == {"m03", "m06"}  # tokenizer and packing, grey in the paper's Figure 1
    for step in ab.LADDER[1:]:
        # the parent is the closest earlier step that was carried forward
        earlier = [s for s in ab.LADDER[: ab.LADDER.index(step)] if s.carried_forward]
        assert step.parent == earlier[-1].step


@pytest.mark.parametrize("step", CHILDREN, ids=lambda s: s.step)
def test_paper_scale_diff_is_exactly_the_documented_change(step):
    parent = load_config(PretrainConfig, ab.step_config_path(step.parent))
    child = load_config(PretrainConfig, ab.step_config_path(step.step))
    child.validate()
    diff = ab.config_diff(parent, child)
    assert set(diff) == set(step.changed_keys), diff


CORPORA = {"demo": "demo.jsonl", "offline": "offline.train.jsonl"}  # what prepare_corpora would write


@pytest.mark.parametrize("budget", ["tiny", "cpu", "small"])
def test_budgets_keep_the_diff_structure(budget):
    scaled = ab.load_budget(budget)
    for step in CHILDREN:
        parent = ab.load_step_config(step.parent, scaled, corpora=CORPORA)
        child = ab.load_step_config(step.step, scaled, corpora=CORPORA)
        diff = ab.config_diff(parent, child)
        assert set(diff) <= set(step.changed_keys), (budget, step.step, diff)
        if step.step != "m02" or budget != "tiny":  # M2's data change is void when both corpora are the demo's
            assert diff, (budget, step.step)


def test_resolved_architecture_of_key_steps():
    resolved = {s.step: NeoBERTConfig.from_preset(c.model.preset, **c.model.overrides)
                for s in ab.LADDER for c in [load_config(PretrainConfig, ab.step_config_path(s.step))]}
    m0, m1, m7, m8, m10 = (resolved[k] for k in ("m00", "m01", "m07", "m08", "m10"))
    assert (m0.position_encoding, m0.activation, m0.norm) == ("learned", "gelu", "layernorm")
    assert (m1.position_encoding, m1.activation, m1.norm) == ("rope", "swiglu", "rmsnorm")
    assert (m0.num_hidden_layers, m0.hidden_size) == (12, 768) and m1.ffn_hidden_size == 2048
    assert (m7.num_hidden_layers, m7.hidden_size) == (16, 1056)
    assert (m8.num_hidden_layers, m8.hidden_size, m8.max_length) == (28, 768, 512)
    assert m10.max_length == 4096
    from neobert.model import NeoBERTForMaskedLM

    # M7 and M8 are the same size (within 10%), both about twice M5's encoder
    import torch
    with torch.device("meta"):
        sizes = {k: NeoBERTForMaskedLM(resolved[k]).num_parameters() for k in ("m05", "m07", "m08")}
    assert abs(sizes["m07"] - sizes["m08"]) / sizes["m08"] < 0.01
    assert sizes["m07"] > 1.8 * sizes["m05"]


def test_batch_tokens_per_step():
    tokens = {s.step: ab.tokens_per_step(load_config(PretrainConfig, ab.step_config_path(s.step))) for s in ab.LADDER}
    assert tokens["m00"] == tokens["m08"] == 131072  # 256 x 512, BERT's batch
    assert tokens["m09"] == tokens["m10"] == 2097152  # 2M tokens


def test_tiny_budget_scales_shapes_and_batches():
    tiny = ab.load_budget("tiny")
    m8 = ab.load_step_config("m08", tiny, corpora=CORPORA)
    m10 = ab.load_step_config("m10", tiny, corpora=CORPORA)
    assert m8.model.overrides["num_hidden_layers"] == 6 and m8.data.source == "demo.jsonl"
    assert m10.data.max_length == 128 == m10.model.overrides["max_length"]
    assert ab.tokens_per_step(m10) == 4096 and m10.trainer.max_steps == tiny.max_steps
    assert m10.optimizer.lr == pytest.approx(6e-4 * tiny.lr_scale)


def test_cpu_budget_data_shapes_and_batches():
    cpu = ab.load_budget("cpu")
    assert cpu.seeds == [0, 1, 2] and cpu.heldout.documents > 0 and cpu.heldout.mask_rate == 0.15
    m1, m2 = (ab.load_step_config(s, cpu, corpora=CORPORA) for s in ("m01", "m02"))
    # Wikipedia -> the demo corpus, RefinedWeb -> the offline corpus without its held-out documents
    assert (m1.data.source, m2.data.source) == ("demo.jsonl", "offline.train.jsonl")
    import torch

    from neobert.model import NeoBERTForMaskedLM
    layers = {}
    for step in ("m05", "m07", "m08"):
        config = ab.load_step_config(step, cpu, corpora=CORPORA)
        with torch.device("meta"):
            model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset(config.model.preset, **config.model.overrides))
        layers[step] = sum(p.numel() for p in model.model.transformer_encoder.parameters())
    # M7 and M8 the same transformer size (the paper's same-size step), 2.5x M5's, as in the paper
    assert abs(layers["m07"] - layers["m08"]) / layers["m08"] < 0.01 and layers["m07"] > 2.4 * layers["m05"]
    m8, m9, m10 = (ab.load_step_config(s, cpu, corpora=CORPORA) for s in ("m08", "m09", "m10"))
    assert ab.tokens_per_step(m9) == ab.tokens_per_step(m10) == 4 * ab.tokens_per_step(m8)
    assert m10.data.max_length == 512 > m9.data.max_length


def test_budget_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="seeds"):
        ab.load_budget("cpu", ["seeds=[0,0]"])
    with pytest.raises(ConfigError, match="pseudo_perplexity_documents"):
        ab.load_budget("cpu", ["heldout.pseudo_perplexity_documents=1000"])
    with pytest.raises(ConfigError, match="data_sources"):
        prepare_corpora(ab.load_budget("tiny", ["data_sources.wikimedia/wikipedia=nowhere.jsonl"]),
                           tmp_path)


def test_parse_steps_and_errors():
    assert ab.parse_steps("m00..m02,m05") == ["m00", "m01", "m02", "m05"]
    assert ab.parse_steps("m00..m10") == [s.step for s in ab.LADDER]
    with pytest.raises(ValueError, match="m11"):
        ab.parse_steps("m00..m11")
    with pytest.raises(ConfigError, match="known budgets"):
        ab.load_budget("huge")


def test_shipped_ladder_configs_and_budgets_use_current_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a renamed key in a shipped file would warn
        for budget in ("tiny", "cpu", "small", "paper"):
            scaled = ab.load_budget(budget)
            for step in ab.LADDER:
                ab.load_step_config(step.step, scaled, corpora=CORPORA)
    tiny = ab.load_step_config("m00", ab.load_budget("tiny"), corpora=CORPORA)
    assert tiny.logging.log_every_n_steps == 5 and tiny.logging.progress_bar is False
    assert tiny.trainer.eval_every_n_steps == 1000


def test_budget_pretrain_overrides_accept_a_renamed_key_with_a_warning():
    budget = ab.load_budget("tiny")
    budget.pretrain_overrides["trainer.log_every_n_steps"] = 3
    with pytest.warns(FutureWarning, match="logging.log_every_n_steps"):
        config = ab.load_step_config("m00", budget, corpora=CORPORA)
    assert config.logging.log_every_n_steps == 3
    with pytest.warns(FutureWarning, match="output_dir"):
        assert ab.load_step_config("m00", overrides=["run_dir=runs/x"]).output_dir == "runs/x"


def test_auto_glue_files_come_from_the_environment_or_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.delenv("NEOBERT_SHARED_DATA", raising=False)
    assert ablation_eval.shared_glue_dir() is None
    (tmp_path / "shared" / "data" / "glue" / "rte").mkdir(parents=True)
    assert ablation_eval.shared_glue_dir().resolve() == (tmp_path / "shared" / "data" / "glue").resolve()
    monkeypatch.setenv("NEOBERT_SHARED_DATA", str(tmp_path / "elsewhere"))
    assert ablation_eval.shared_glue_dir() is None  # set, without rte/: the fallback task
    (tmp_path / "elsewhere" / "glue" / "rte").mkdir(parents=True)
    assert ablation_eval.shared_glue_dir() == tmp_path / "elsewhere" / "glue"
