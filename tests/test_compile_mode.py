"""model.compile_mode: torch.compile's mode reaches the model, CUDA-graph modes are refused where batches change shape,
and every forward of the module under them starts a new CUDA-graph step."""

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


@pytest.mark.parametrize("strategy", ["auto", "ddp", "fsdp2", "deepspeed_stage_1", "deepspeed_stage_3",
                                      "deepspeed_stage_2 trainer.deepspeed.contiguous_gradients=false"])
def test_cuda_graphs_with_gradient_accumulation_need_a_strategy_that_copies_the_gradients_out(tmp_path, strategy):
    """A CUDA graph's outputs (the gradients AccumulateGrad keeps as param.grad) live in memory the next micro-batch's
    replay reuses: accumulated there they would be wrong. ZeRO-2 with contiguous gradients copies them out in its
    hooks (tests/test_deepspeed.py simulates the replay); ZeRO-1, or ZeRO-2 without contiguous gradients, does not."""
    graphs = (*PACKED, "model.compile_mode=reduce-overhead")
    strategy_keys = (f"trainer.strategy={strategy}").split()
    with pytest.raises(ConfigError, match=r"model\.compile_mode.*accumulate_grad_batches=4 under "
                                          rf"trainer\.strategy={strategy.split()[0]}.*deepspeed_stage_2") as refused:
        tiny_config(tmp_path, *graphs, "trainer.accumulate_grad_batches=4", *strategy_keys)
    # "without contiguous gradients" only where that is why: ZeRO-2 with them turned off
    assert ("without contiguous gradients" in str(refused.value)) == ("contiguous_gradients=false" in strategy)
    tiny_config(tmp_path, *graphs, "trainer.accumulate_grad_batches=1", *strategy_keys)
    tiny_config(tmp_path, *PACKED, "trainer.accumulate_grad_batches=4", *strategy_keys)  # no graphs
    for allowed in ("deepspeed_stage_2", "deepspeed_stage_2_offload"):
        tiny_config(tmp_path, *graphs, "trainer.accumulate_grad_batches=4", f"trainer.strategy={allowed}")


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


def test_a_scope_needs_model_compile_and_a_known_name(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.compile_scope.*model\.compile=true"):
        tiny_config(tmp_path, "model.compile_scope=blocks")
    with pytest.raises(ConfigError, match=r"model\.compile_scope.*one of"):
        tiny_config(tmp_path, "model.compile=true", "model.compile_scope=layers")


def test_the_blocks_scope_compiles_each_encoder_block_and_leaves_the_rest_eager(tmp_path, monkeypatch):
    """Regional compilation: every block's forward compiled (one graph they share), the embedding and the MLM head
    not; the scope and the mode reach it from the pretraining config."""
    config = tiny_config(tmp_path, *PACKED, "model.compile_scope=blocks",
                         "model.compile_mode=max-autotune-no-cudagraphs")
    tokenizer, model_config, _ = prepare(config)
    module = MLMPretrainingModule(config, model_config, tokenizer)
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **kw: compiled.append((self, kw)))
    module.configure_model()
    blocks = list(module.model.model.transformer_encoder)
    assert [m for m, _ in compiled] == blocks
    assert all(kw == {"mode": "max-autotune-no-cudagraphs"} for _, kw in compiled)


def test_per_block_compilation_computes_what_the_eager_model_does():
    """The compiled blocks (Dynamo with the eager backend: no code generation, seconds on CPU) give the eager loss and
    gradients, the model's own `compile(scope=...)` on a tiny model."""
    from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

    torch.manual_seed(0)
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    regional = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    regional.load_state_dict(eager.state_dict())
    regional.compile(scope="blocks", backend="eager", fullgraph=True)
    ids = torch.randint(5, 1000, (2, 16))
    labels = torch.where(ids % 4 == 0, ids, -100)
    losses = []
    for model in (eager, regional):
        loss = model(ids, labels=labels, masked_only=True).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for p_regional, p_eager in zip(regional.parameters(), eager.parameters()):
        torch.testing.assert_close(p_regional.grad, p_eager.grad)
    assert all(block._compiled_call_impl is not None for block in regional.model.transformer_encoder)
    assert regional._compiled_call_impl is None and regional.decoder._compiled_call_impl is None
    with pytest.raises(ValueError, match="scope"):
        regional.compile(scope="layers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and Inductor's GPU kernels need a CUDA GPU")
@pytest.mark.parametrize("scope, mode", [("blocks", "default"), ("blocks", "reduce-overhead"), ("model", "default")])
def test_compiled_training_steps_equal_eager_on_cuda(scope, mode):
    """The tiny model's packed training step compiled as the pretraining module compiles it (each forward a new
    CUDA-graph step), three steps in a row (CUDA graphs record on the first calls, replay after; without them, each
    step with its own number of documents): the eager loss and gradients, within bf16 tolerance."""
    from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

    torch.manual_seed(0)
    device = torch.device("cuda")
    eager = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", attention_backend="varlen")).to(device)
    compiled = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", attention_backend="varlen")).to(device)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(dynamic=False, mode=mode, scope=scope)
    # CUDA graphs: one fixed cu_seqlens (an empty filler document, as a static batch has); otherwise each step has
    # its own number of documents, a dynamic size as MLMPretrainingModule.forward marks it; max_seqlen the row length
    documents = [[0, 100, 256, 256]] * 3 if mode == "reduce-overhead" else [[0, 100, 256], [0, 30, 130, 256], [0, 256]]
    for step, offsets in enumerate(documents):
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
        if mode != "reduce-overhead":
            torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        ids = torch.randint(5, 30000, (256,), device=device)
        labels = torch.where(torch.rand(ids.shape, device=device) < 0.2, ids, torch.full_like(ids, -100))
        index = torch.arange(0, 256, 4, device=device)  # a fixed-length masked_index, as StaticShapes makes
        losses, grads = [], []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            if model is compiled and mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=labels, masked_index=index, cu_seqlens=cu_seqlens, max_seqlen=256).loss
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.float().clone() for p in model.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2, msg=f"step {step}")
        for grad_compiled, grad_eager in zip(grads[1], grads[0]):
            assert (grad_compiled - grad_eager).abs().max() / grad_eager.abs().max().clamp(min=1e-6) < 5e-2


@pytest.mark.parametrize("device, mode, enforced", [("cuda", "reduce-overhead", True), ("cuda", "max-autotune", True),
                                                    ("cuda", "default", False), ("cpu", "reduce-overhead", False)])
def test_where_cuda_graphs_are_measured_a_graph_inductor_would_run_without_them_raises(device, mode, enforced):
    """cuda_graphs_or_error: Inductor's cudagraph_or_error on, for a GPU under a CUDA-graph mode only, and restored."""
    import torch._inductor.config as inductor_config

    from neobert.instruments.kernel_profile import cuda_graphs_or_error

    assert inductor_config.triton.cudagraph_or_error is False
    with cuda_graphs_or_error(torch.device(device), mode):
        assert inductor_config.triton.cudagraph_or_error is enforced
    assert inductor_config.triton.cudagraph_or_error is False


def test_the_throughput_job_and_the_gpu_check_measure_under_cuda_graphs_or_error(tmp_path, monkeypatch):
    from test_gpu_check import tiny_check

    from experiments.gpu_check import parse_args as gpu_check_args
    from neobert.config.throughput import ThroughputConfig
    from neobert.instruments import gpu_check, throughput

    asked = []

    def record(device, mode):
        asked.append((device.type, mode))
        raise RuntimeError("stop here")

    for job in (throughput, gpu_check):
        monkeypatch.setattr(job, "cuda_graphs_or_error", record)
    config = ThroughputConfig(models=["neobert"], neobert_preset="tiny", lengths=[16], batch_sizes=[2], repeats=1,
                              device="cpu", compile=True, compile_mode="reduce-overhead", warmup=2,
                              output_dir=str(tmp_path / "t"))
    with pytest.raises(RuntimeError, match="stop here"):
        throughput.run_throughput(config)
    with pytest.raises(RuntimeError, match="stop here"):
        gpu_check.run_gpu_check(gpu_check_args(tiny_check(tmp_path, "data.packing=best_fit", "model.compile=true",
                                                          "model.compile_mode=reduce-overhead", "ceiling_warmup=2")))
    assert asked == [("cpu", "reduce-overhead"), ("cpu", "reduce-overhead")]
