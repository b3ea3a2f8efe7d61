"""model.compile_mode: torch.compile's mode reaches the model, CUDA-graph modes are refused where batches change shape,
and every forward of the module under them starts a new CUDA-graph step (issue 34: CUDA graphs for the step)."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import tiny_config

from neobert.config import ConfigError
from neobert.jobs.pretrain import prepare
from neobert.lit.pretrain import MLMPretrainingModule

PACKED = ("data.packing=best_fit", "model.compile=true")


def test_a_mode_needs_model_compile(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.compile_mode.*model\.compile=true"):
        tiny_config(tmp_path, "model.compile_mode=reduce-overhead")


def test_an_unknown_mode_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.compile_mode.*one of"):
        tiny_config(tmp_path, *PACKED, "model.compile_mode=fast")


@pytest.mark.parametrize("shapes", [("data.packing=none",), ("data.packing=greedy", "data.static_shapes=false")])
def test_cuda_graphs_are_refused_for_batches_of_changing_shape(tmp_path, shapes):
    with pytest.raises(ConfigError, match=r"model\.compile_mode.*CUDA graphs.*one shape"):
        tiny_config(tmp_path, "model.compile=true", "model.compile_mode=reduce-overhead", *shapes)
    tiny_config(tmp_path, "model.compile=true", "model.compile_mode=max-autotune-no-cudagraphs", *shapes)  # no graphs


def test_the_mode_reaches_torch_compile_and_each_forward_begins_a_cuda_graph_step(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, *PACKED, "model.compile_mode=reduce-overhead")
    assert config.data.static_shapes == "true"  # auto follows model.compile
    tokenizer, model_config, _ = prepare(config)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    modes, steps = [], []
    monkeypatch.setattr(module.model, "compile", lambda **kwargs: modes.append(kwargs.get("mode")))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    module.configure_model()
    assert modes == ["reduce-overhead"]
    ids = torch.randint(5, 100, (2, 8))
    batch = {"input_ids": ids, "labels": torch.where(ids % 3 == 0, ids, -100)}
    module(batch)
    module(batch)
    assert len(steps) == 2


def test_without_cuda_graphs_no_step_is_marked(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, *PACKED)
    tokenizer, model_config, _ = prepare(config)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: pytest.fail("no CUDA graphs here"))
    ids = torch.randint(5, 100, (2, 8))
    module({"input_ids": ids, "labels": torch.where(ids % 3 == 0, ids, -100)})
