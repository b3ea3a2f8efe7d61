"""Data mixtures (data.sources): the realised shares converge to the targets (weights, or size^temperature), a source
retires after its max_epochs with the others renormalised, the mixed stream resumes exactly, a run logs each
source's tokens, share and held-out loss, and every bad input is an error naming its key."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import re
from collections import Counter

import lightning as L
import pytest
import torch
from test_pretrain import crash_and_resume, tiny_config

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import MaskingConfig, PretrainConfig, PretrainDataConfig
from neobert.data.mixture import mixture_sources
from neobert.data.pretraining import PretrainingStream
from neobert.data.stream_state import DATA_STATE_KEY, MixtureState, batch_stream_state
from neobert.data.tokenizer import load_tokenizer
from neobert.errors import DataError
from neobert.jobs.pretrain import prepare, run_pretraining

MARKERS = ("alpha", "beta", "gamma")  # the first word of every document of source 0, 1, 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def write_source(path, marker: str, docs: int, words: int = 12):
    with path.open("w") as f:
        for i in range(docs):
            f.write(json.dumps({"content": f"{marker} " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(words))})
                    + "\n")
    return path


@pytest.fixture
def three_sources(tmp_path):
    """Three local sources of 60, 30 and 15 documents (sizes in bytes roughly 4:2:1)."""
    return [write_source(tmp_path / f"{m}.jsonl", m, docs) for m, docs in zip(MARKERS, (60, 30, 15))]


def sources_yaml(paths, weights=(1, 1, 1), **extra) -> str:
    entries = []
    for marker, path, weight in zip(MARKERS, paths, weights):
        fields = {"name": marker, "source": str(path), "weight": weight, **extra.get(marker, {})}
        entries.append("{" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}")
    return "data.sources=[" + ", ".join(entries) + "]"


def mixture_data(paths, weights=(1, 1, 1), temperature: float = 0.0, **extra) -> PretrainDataConfig:
    overrides = [sources_yaml(paths, weights, **extra), f"data.mixture_temperature={temperature}",
                 "data.max_length=32", "data.shuffle_buffer=8", "data.num_workers=0"]
    return load_config(PretrainConfig, None, overrides).data


def drawn_markers(data, tokenizer, n: int, state=None) -> list[str]:
    ids = {tokenizer.convert_tokens_to_ids(m): m for m in MARKERS}
    stream = PretrainingStream(data, MaskingConfig(), tokenizer, 4)
    state = state if state is not None else MixtureState.fresh(len(MARKERS))
    documents = stream.mixed(0, state)
    return [ids[doc[1]] for doc in itertools.islice(documents, n)]  # doc[0] is [CLS]


def test_realised_shares_converge_to_the_weights(three_sources, tokenizer):
    data = mixture_data(three_sources, weights=(5, 3, 2))
    counts = Counter(drawn_markers(data, tokenizer, 3000))
    # 3,000 seeded draws: a share's standard deviation is at most 0.009; 0.03 is over 3 of them
    for marker, target in zip(MARKERS, (0.5, 0.3, 0.2)):
        assert counts[marker] / 3000 == pytest.approx(target, abs=0.03), counts
    assert drawn_markers(data, tokenizer, 200) == drawn_markers(data, tokenizer, 200)  # seeded


def test_temperature_sampling_follows_size_to_the_power_tau(three_sources, tokenizer):
    sizes = [p.stat().st_size for p in three_sources]
    for tau in (1.0, 0.5, 0.3):
        data = mixture_data(three_sources, temperature=tau)
        expected = [size**tau / sum(s**tau for s in sizes) for size in sizes]
        assert [s.probability for s in mixture_sources(data)] == pytest.approx(expected, rel=1e-12)
    data = mixture_data(three_sources, temperature=0.3)
    counts = Counter(drawn_markers(data, tokenizer, 3000))
    for marker, source in zip(MARKERS, mixture_sources(data)):
        assert counts[marker] / 3000 == pytest.approx(source.probability, abs=0.03), counts
    # a stated size wins over the measured bytes
    stated = mixture_data(three_sources, temperature=0.5, alpha={"size": 100}, beta={"size": 100},
                          gamma={"size": 100})
    assert [s.probability for s in mixture_sources(stated)] == pytest.approx([1 / 3] * 3)


def test_a_source_retires_after_its_max_epochs_and_the_others_renormalise(three_sources, tokenizer, caplog):
    data = mixture_data(three_sources, weights=(1, 1, 8), gamma={"max_epochs": 2})
    state = MixtureState.fresh(len(MARKERS))
    with caplog.at_level(logging.INFO, logger="neobert.data.mixture"):
        drawn = drawn_markers(data, tokenizer, 400, state)
    assert Counter(drawn)["gamma"] == 30  # 15 documents, twice, then never again
    last_gamma = max(i for i, m in enumerate(drawn) if m == "gamma")
    assert Counter(drawn[last_gamma + 1:]).keys() <= {"alpha", "beta"} and len(drawn) - last_gamma > 100
    assert state.retired == [2]
    assert "source 'gamma' starts its epoch 1" in caplog.text
    assert "source 'gamma' finished its max_epochs=2 (stream 0): retired; the others' shares are now " \
           "{'alpha': 0.5, 'beta': 0.5}" in caplog.text


def test_every_source_retired_is_a_data_error(three_sources, tokenizer):
    limits = {m: {"max_epochs": 1} for m in MARKERS}
    with pytest.raises(DataError, match="every source of data.sources has reached its max_epochs"):
        drawn_markers(mixture_data(three_sources, **limits), tokenizer, 200)


def test_the_mixed_stream_resumes_exactly_from_any_batch(three_sources, tokenizer):
    data = mixture_data(three_sources, weights=(2, 1, 1), gamma={"max_epochs": 3})
    straight = list(itertools.islice(iter(PretrainingStream(data, MaskingConfig(), tokenizer, 4)), 60))
    tokens = [sum(b[DATA_STATE_KEY]["stats"]["source_tokens"].values()) for b in straight]
    assert all(t > 0 for t in tokens)
    for k in (3, 24, 41):  # across blocks, epochs and gamma's retirement
        state = batch_stream_state(straight[k])
        resumed = PretrainingStream(data, MaskingConfig(), tokenizer, 4, start_states={0: state})
        for a, b in zip(straight[k + 1:k + 8], itertools.islice(iter(resumed), 7)):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
            assert a[DATA_STATE_KEY]["stats"] == b[DATA_STATE_KEY]["stats"]


@pytest.mark.parametrize("change, key, message", [
    ({"weights": (1, -1, 1)}, "data.sources[1].weight", "must be >= 0"),
    ({"weights": (0, 0, 0)}, "data.sources", "every weight is 0"),
    ({"beta": {"name": "alpha"}}, "data.sources[1].name", "'alpha' names two sources"),
    ({"beta": {"name": "'a b'"}}, "data.sources[1].name", "letters, digits"),
    ({"gamma": {"max_epochs": -1}}, "data.sources[2].max_epochs", "must be >= 0"),
    ({"gamma": {"source": "/nowhere/docs.jsonl"}}, "data.sources[2].source", "does not exist"),
])
def test_bad_mixtures_name_the_key(three_sources, tmp_path, change, key, message):
    weights = change.pop("weights", (1, 1, 1))
    overrides = [sources_yaml(three_sources, weights, **change), "model.preset=tiny", "data.max_length=32", "data.num_workers=0",
                 "trainer.accelerator=cpu", f"output_dir={tmp_path / 'run'}"]
    key = re.escape(key)
    with pytest.raises(ConfigError, match=rf"invalid config key '{key}'.*{message}|{key}='.*{message}"):
        prepare(load_config(PretrainConfig, None, overrides))


def test_more_bad_mixtures_name_the_key(three_sources, tmp_path):
    with pytest.raises(ConfigError, match=r"'data.sources': replaces data.source: .*data.source=null clears it"):
        load_config(PretrainConfig, None, [sources_yaml(three_sources), "data.source=x.jsonl"])
    with pytest.raises(ConfigError, match=r"'data.sources\[0\].size': 'some/hub-set' is not local"):
        mixture_sources(load_config(PretrainConfig, None, [
            "data.sources=[{name: hub, source: some/hub-set}]", "data.mixture_temperature=0.5"]).data)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    overrides = [sources_yaml([three_sources[0], empty]), "model.preset=tiny", "data.max_length=32", "data.num_workers=0",
                 "trainer.accelerator=cpu", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(DataError, match=r"data.sources\[1\].source='.*empty.jsonl' has no usable documents"):
        prepare(load_config(PretrainConfig, None, overrides))


@pytest.mark.slow
def test_a_run_logs_each_source_and_resumes_exactly(three_sources, tmp_path):
    mixture = [sources_yaml(three_sources, (3, 2, 1)), "data.source=null",
               "data.validation_docs=8", "trainer.eval_every_n_steps=3", "data.num_workers=2",
               "trainer.accumulate_grad_batches=2", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=2",
               "data.shuffle_buffer=8"]
    straight, _, second = crash_and_resume(tmp_path, mixture, crash_at=3)
    # the crash at step 3 resumes from the checkpoint of step 2: steps 2-5, two micro-batches each
    assert len(straight.batches) == 12 and len(second.batches) == 8
    for (ids_a, labels_a), (ids_b, labels_b) in zip(straight.batches[4:], second.batches):
        assert torch.equal(ids_a, ids_b) and torch.equal(labels_a, labels_b)
    assert second.losses == pytest.approx(straight.losses[4:], abs=1e-6)

    with open(next((tmp_path / "a" / "run" / "logs").glob("version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    last = [r for r in rows if r.get("train/share/alpha")][-1]
    shares = [float(last[f"train/share/{m}"]) for m in MARKERS]
    assert sum(shares) == pytest.approx(1.0) and all(s > 0 for s in shares)
    assert all(float(last[f"train/tokens/{m}"]) > 0 for m in MARKERS)
    validated = [r for r in rows if r.get("val/loss")]
    assert validated and all(r.get(f"val/loss/{m}") for r in validated for m in MARKERS)


def test_the_preflight_reports_every_source_and_pretokenize_refuses_a_mixture(three_sources, tmp_path):
    from neobert.instruments.preflight import preflight_report
    from neobert.jobs.pretrain import run_pretokenize

    config = tiny_config(tmp_path, sources_yaml(three_sources, (2, 1, 1), gamma={"max_epochs": 2}),
                         "data.source=null", "trainer.devices=2", "data.num_workers=1", "data.validation_docs=0")
    text = preflight_report(config).text()
    assert "- source alpha (50.0% of the draws): " in text and "- source beta (25.0% of the draws): " in text
    assert "- source gamma (25.0% of the draws, retired after 2 epoch(s)): " in text
    assert text.count("shards: 1, not a multiple of 2") == 3
    with pytest.raises(ConfigError, match="'data.sources': --pretokenize writes one source"):
        run_pretokenize(config, tmp_path / "shards")


@pytest.mark.parametrize("kind, cls, sep", [("wordpiece", "[CLS]", "[SEP]"), ("bpe", "<s>", "</s>")])
def test_a_tokenizer_trained_on_a_mixture_pads_its_vocabulary_and_trains_a_model(three_sources, tmp_path, kind,
                                                                                 cls, sep):
    from experiments.train_tokenizer import main as train_main
    from neobert.jobs.pretrain import build_model_config

    directory = train_main([str(tmp_path / "tok"), "--kind", kind, "--vocab-size", "600", "--max-docs", "90",
                            sources_yaml(three_sources, (1, 1, 1)), "data.source=null", "data.validation_docs=5"])
    tokenizer = load_tokenizer(str(directory))
    learnt = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    assert len(tokenizer) % 64 == 0 and len(tokenizer) - 64 < learnt <= len(tokenizer)  # padded to the next 64
    ids = tokenizer("alpha word1 gamma")["input_ids"]
    assert tokenizer.convert_ids_to_tokens([ids[0], ids[-1]]) == [cls, sep]
    assert tokenizer.mask_token_id is not None and tokenizer.pad_token_id is not None
    # every source taught it: its markers are whole tokens
    assert all(len(tokenizer.tokenize(m)) == 1 for m in MARKERS)
    config = tiny_config(tmp_path, f"data.tokenizer={directory}", "trainer.max_steps=1")
    assert build_model_config(config, tokenizer).vocab_size == len(tokenizer)
    run_pretraining(config)


def test_a_phase_reweights_sources_by_name_and_an_unknown_name_is_refused(three_sources, tmp_path):
    from neobert.jobs.phases import plan_phases, run_phases

    mixture = [sources_yaml(three_sources), "data.source=null", "trainer.max_steps=4"]
    reweighted = "phases=[{name: a, steps: 2}, {name: b, overrides: {data.source_weights: {alpha: 0, beta: 3}}}]"
    config = tiny_config(tmp_path, *mixture, reweighted)
    a, b = (mixture_sources(run.config.data) for run in plan_phases(config))
    assert [s.probability for s in a] == pytest.approx([1 / 3] * 3)
    assert [s.probability for s in b] == pytest.approx([0, 0.75, 0.25])

    class Markers(L.Callback):
        seen: dict = {}

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            drawn = batch[DATA_STATE_KEY]["stats"]["source_tokens"]
            self.seen.setdefault(trainer.global_step, Counter()).update(
                {name: 1 for name, tokens in drawn.items() if tokens})

    markers = Markers()
    run_phases(config, extra_callbacks=[markers])
    assert any(markers.seen[step]["alpha"] for step in (0, 1))  # drawn in a
    assert all(not markers.seen[step]["alpha"] for step in (2, 3))  # alpha's weight is 0 from b's first step
    unknown = tiny_config(tmp_path, *mixture, reweighted.replace("beta: 3", "delta: 3"))
    with pytest.raises(ConfigError, match=r"'data.source_weights.delta': is not a source of data.sources: "
                                          r"\['alpha', 'beta', 'gamma'\] \(in phase 1, 'b'\)"):
        plan_phases(unknown)


def test_a_new_phase_carries_each_shared_source_position_and_counts_its_own_draws():
    from neobert.data.stream_state import MixtureState, StreamState, carried_state

    web, wiki, code = ("web", None, "train", "text", "paragraph"), ("wiki",) * 5, ("code",) * 5
    old = StreamState(batches=12, builder={"pending": [[1, 2]]}, mixture=MixtureState.fresh(2))
    old.mixture.draws, old.mixture.tokens, old.mixture.documents = 40, [900, 300], [30, 10]
    old.mixture.sources[0].epoch, old.mixture.sources[0].block, old.mixture.sources[0].taken = 1, 3, 7
    new = carried_state(old, [web, wiki], [code, web])
    assert new.batches == 0 and new.builder is None
    assert new.mixture.draws == 40  # the source draws go on
    assert new.mixture.sources[1] == old.mixture.sources[0]  # web, by identity, wherever it is listed
    assert new.mixture.sources[0].epoch == 0 and new.mixture.sources[0].taken == 0  # code: new
    assert new.mixture.tokens == [0, 0] and new.mixture.documents == [0, 0]  # this phase's own counts
    single = carried_state(old, [web, wiki], [web])  # a mixture into one source: its position
    assert (single.position.epoch, single.position.block, single.position.taken, single.mixture) == (1, 3, 7, None)
