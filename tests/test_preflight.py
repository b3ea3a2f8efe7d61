"""The preflight of the paper's configs at 8 GPUs, on CPU and offline: the strategy and the DeepSpeed config Lightning
would build, the batch arithmetic, memory from DeepSpeed's estimators, the attention kernel and the MFU peak; and
what would crash is refused with the key named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_pretrain import tiny_config

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import PretrainConfig
from neobert.instruments.preflight import preflight_report, run_preflight

pytest.importorskip("deepspeed")
EIGHT_GPUS = ["trainer.devices=8", "trainer.num_nodes=1"]


def deepspeed_config(text: str) -> dict:
    return json.loads(re.search(r"```json\n(.*?)\n```", text, re.S)[1])


@pytest.mark.parametrize("name, micro, length", [("neobert", 32, 1024), ("neobert-4096", 8, 4096),
                                                 ("recipes/neobert-wsd", 32, 1024)])
def test_the_paper_configs_at_8_gpus(name, micro, length):
    report = preflight_report(load_config(PretrainConfig, name, EIGHT_GPUS))
    text = report.text()
    assert not report.refusals, text
    config = deepspeed_config(text)
    assert config["train_micro_batch_size_per_gpu"] == micro and config["gradient_accumulation_steps"] == 8
    assert config["zero_optimization"]["stage"] == 2
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert config["gradient_clipping"] == 1.0
    assert f"= 2,048 sequences per optimizer step" in text if length == 1024 else "= 512 sequences" in text
    assert "2,097,152 token slots per step" in text  # the paper's 2M tokens
    assert "NeoBERTDeepSpeedStrategy" in text
    assert re.search(r"model states \(DeepSpeed's ZeRO-2 estimator, 8 GPUs\): \d+\.\d+ GiB", text)
    assert "peak of a NVIDIA H100 80GB HBM3: 989 dense bf16 TFLOP/s" in text
    assert "shards: unknown here" in text  # RefinedWeb is on the hub, which this machine cannot reach
    assert "unpadded documents (data.unpad) with cu_seqlens: PyTorch's varlen_attn (FlashAttention varlen)" in text
    workers = re.search(r"consumes ([\d,]+) tokens/s: about (\d+) worker\(s\) per GPU at that rate; data.num_workers=4",
                        text)
    assert workers and int(workers[2]) >= 1, text


def test_lightnings_own_deepspeed_strategy_is_refused(monkeypatch):
    # What the paper's config ran before: Lightning's strategy from its name reads the micro-batch size from
    # train_dataloader.batch_sampler, which our DataLoader of ready batches does not have (AttributeError at setup).
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from neobert.instruments import preflight

    monkeypatch.setattr(preflight, "build_strategy", lambda trainer, micro_batch_size: DeepSpeedStrategy(stage=2))
    report = preflight_report(load_config(PretrainConfig, "neobert", EIGHT_GPUS))
    assert [key for key, _ in report.refusals] == ["trainer.strategy"]
    assert "Lightning cannot format the DeepSpeed config: AttributeError" in report.refusals[0][1]


def test_the_report_on_the_command_line(capsys):
    from experiments.pretrain import main

    main(["--config", "neobert", "--preflight", *EIGHT_GPUS, "--gpu", "NVIDIA H100 PCIe"])
    out = capsys.readouterr().out
    assert out.startswith("# Preflight: runs/neobert on 1 node(s) x 8 GPU(s) (NVIDIA H100 PCIe)")
    assert "peak of a NVIDIA H100 PCIe: 756 dense bf16 TFLOP/s" in out


def test_local_shards_against_streams(tmp_path):
    for i in range(3):
        (tmp_path / f"part-{i}.jsonl").write_text('{"content": "some text here"}\n' * 4)
    config = tiny_config(tmp_path, f"data.source={tmp_path}/part-*.jsonl", "trainer.devices=2",
                         "data.num_workers=2", "data.validation_docs=0")
    report = preflight_report(config)
    assert "shards: 3, not a multiple of 4" in report.text()
    assert any("choose data.streams so that it divides the shards" in w for w in report.warnings)
    even = preflight_report(tiny_config(tmp_path, f"data.source={tmp_path}/part-*.jsonl", "trainer.devices=3",
                                        "data.num_workers=1", "data.validation_docs=0"))
    assert "shards: 3, a multiple of 3: every stream reads 1 whole shard(s)" in even.text()
    # a layout whose readers cannot share the streams evenly would stop at setup: refused naming data.streams
    odd = preflight_report(tiny_config(tmp_path, f"data.source={tmp_path}/part-*.jsonl", "trainer.devices=3",
                                       "data.num_workers=1", "data.validation_docs=0", "data.streams=8"))
    assert odd.refusals and "data.streams=8 cannot be read by 3 device(s) x 1 data.num_workers" in odd.text()


def test_what_would_crash_is_refused_naming_the_key(tmp_path, capsys):
    config = tiny_config(tmp_path, "trainer.devices=8", "data.validation_docs=8", "trainer.micro_batch_size=4")
    with pytest.raises(ConfigError, match=r"invalid config key 'data.validation_docs': 8 documents \(of each source\) make at most 2 "
                                          r"validation batches of 4, fewer than the 8 ranks"):
        run_preflight(config)
    assert "REFUSED (data.validation_docs)" in capsys.readouterr().out  # the whole report was printed first


def test_a_phased_recipe_reports_every_phase():
    text = preflight_report(load_config(PretrainConfig, "recipes/ettin-style", EIGHT_GPUS)).text()
    assert "## Phases (the sections above are the first phase's)" in text
    assert ("- extension: steps 810,624-929,834 (250.0B token slots at 2,097,152 per step), length 8192, "
            "micro-batch 4, masking 0.15, RoPE base 160000.0") in text
    assert "- source dclm (60.0% of the draws): mlfoundations/dclm-baseline-1.0" in text


def test_the_derived_values_are_shown(tmp_path):
    text = preflight_report(tiny_config(tmp_path, "data.packing=best_fit", "model.compile=true")).text()
    assert ("- data.static_shapes=true (auto is model.compile's value): every packed micro-batch has one shape, for "
            "one compiled graph") in text
    assert ("- the model's attention_backend: varlen (derived from the data: its batches carry cu_seqlens "
            "(data.packing, data.unpad); model.overrides.attention_backend sets another)") in text
    text = preflight_report(tiny_config(tmp_path, "data.packing=none", "data.unpad=false")).text()
    assert "data.static_shapes" not in text  # padded batches: it does not apply
    assert "- the model's attention_backend: sdpa (model.preset tiny's)" in text
    text = preflight_report(tiny_config(tmp_path, "model.overrides.attention_backend=sdpa")).text()
    assert "- the model's attention_backend: sdpa (model.overrides.attention_backend)" in text


def saved_bytes(model, length: int, precision: str, scored_every: int = 0) -> int:
    """The bytes of the distinct storages autograd keeps for the backward of one forward of `length` tokens on the CPU
    (weights and their 16-bit copies included; differences between two runs cancel them). `scored_every`: an MLM
    forward scoring every n-th position, as the masked_index path of pretraining does."""
    import torch

    kept = {}

    def keep(tensor):
        kept.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    ids = torch.randint(5, 1000, (1, length))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        if scored_every:
            index = torch.arange(0, length, scored_every)
            labels = torch.full_like(ids, -100)
            labels.view(-1)[index] = ids.view(-1)[index]
            model(ids, labels=labels, masked_index=index)
        else:
            model(ids)
    return sum(kept.values())


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
@pytest.mark.parametrize("architecture", [{}, dict(activation="gelu", norm="layernorm", position_encoding="learned")],
                         ids=["neobert", "bert-like"])
def test_the_activation_estimate_is_what_the_model_keeps_for_its_backward(precision, architecture):
    """Per token and layer (two lengths and two depths differenced, so weights cancel), and per scored row of the
    MLM head: the preflight's term-by-term estimate against the tensors the model saves. One known difference: the
    CPU's RMSNorm is not one fused kernel, and also keeps its normalised input for the weight's gradient."""
    import torch

    from neobert.instruments.preflight_memory import activation_bytes
    from neobert.model import NeoBERT, NeoBERTConfig, NeoBERTForMaskedLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    configs = {layers: NeoBERTConfig.from_preset("tiny", num_hidden_layers=layers, **architecture) for layers in (1, 2)}
    kept = {(layers, length): saved_bytes(NeoBERT(config).to(dtype), length, precision)
            for layers, config in configs.items() for length in (64, 128)}
    measured = ((kept[2, 128] - kept[2, 64]) - (kept[1, 128] - kept[1, 64])) / 64
    estimated = activation_bytes(configs[2], 1, precision, 0) - activation_bytes(configs[1], 1, precision, 0)
    hidden = configs[1].hidden_size
    unfused_norms = 2 * (2 if precision == "bf16-true" else 4) * hidden if configs[1].norm == "rmsnorm" else 0
    assert measured == pytest.approx(estimated + unfused_norms, rel=0.03)

    mlm = NeoBERTForMaskedLM(configs[1]).to(dtype)
    rows = (128 - 64) / 4
    measured_head = ((saved_bytes(mlm, 128, precision, 4) - saved_bytes(mlm, 64, precision, 4))
                     - (saved_bytes(mlm.model, 128, precision) - saved_bytes(mlm.model, 64, precision))) / rows
    gradient = 8 * configs[1].vocab_size  # in the estimate: the two gradients of the head's peak, alive, not saved
    estimated_head = (activation_bytes(configs[1], 0, precision, rows) - rows * gradient) / rows
    assert measured_head == pytest.approx(estimated_head, rel=0.03)


class LiveBytes:
    """The bytes of the tensors alive (every storage an operator made, until it is freed) when each operator returns,
    the largest for each operator's name in `at`: a CPU's view of what a step holds at a given point."""

    def __init__(self):
        import weakref

        import torch
        import torch.utils._pytree as pytree
        from torch.utils._python_dispatch import TorchDispatchMode

        live = self
        self.alive: dict[int, int] = {}
        self.now = 0
        self.at: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in pytree.tree_leaves(out):
                    if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
                        storage = tensor.untyped_storage()
                        if storage.data_ptr() not in live.alive:
                            live.alive[storage.data_ptr()] = storage.nbytes()
                            live.now += storage.nbytes()
                            weakref.finalize(storage, live.free, storage.data_ptr())
                name = str(func.overloadpacket)
                live.at[name] = max(live.at.get(name, 0), live.now)
                return out

        self.mode = Mode()

    def free(self, key: int) -> None:
        self.now -= self.alive.pop(key, 0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_the_heads_estimate_is_what_the_step_holds_at_the_log_softmaxs_backward(precision):
    """The MLM head's term per scored row against the live tensors of a forward + backward on a CPU when the
    log-softmax's backward returns (the head's peak, with every activation of the encoder still held), two masking
    densities over the same tokens differenced (the encoder's and the weights' bytes cancel): the kept decoder input
    and log-probabilities, and two float32 vocabulary-wide gradients, the log-probabilities' and the logits'
    (the estimate counted one until 2026-11-26)."""
    import torch

    from neobert.instruments.preflight_memory import activation_bytes
    from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

    torch.manual_seed(0)
    config = NeoBERTConfig.from_preset("tiny")
    model = NeoBERTForMaskedLM(config).to(torch.bfloat16 if precision == "bf16-true" else torch.float32)
    ids = torch.randint(5, 1000, (1, 128))

    def held_at_the_heads_backward(scored_every: int) -> int:
        index = torch.arange(0, ids.numel(), scored_every)
        labels = torch.full_like(ids, -100)
        labels.view(-1)[index] = ids.view(-1)[index]
        live = LiveBytes()
        with live.mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            model(ids, labels=labels, masked_index=index).loss.backward()
        model.zero_grad(set_to_none=True)
        return live.at["aten._log_softmax_backward_data"]

    rows = 128 / 2 - 128 / 8
    measured = (held_at_the_heads_backward(2) - held_at_the_heads_backward(8)) / rows
    estimated = activation_bytes(config, 0, precision, rows) / rows
    assert measured == pytest.approx(estimated, rel=0.03)


def test_with_the_fused_loss_the_heads_estimate_keeps_no_logits(monkeypatch):
    """Liger's fused linear cross-entropy keeps no row of logits: its head costs the same per masked row whatever
    the vocabulary, where the eager head holds three float32 vocabulary-wide rows at its peak."""
    from neobert.instruments.preflight_memory import activation_bytes
    from neobert.model import NeoBERTConfig
    from neobert.model import config as model_config_module

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    per_row = {}
    for fused in (False, True):
        for vocab in (1000, 30522):
            config = NeoBERTConfig.from_preset("tiny", vocab_size=vocab, fused_mlm_loss=fused)
            per_row[fused, vocab] = (activation_bytes(config, 0, "bf16-mixed", 2, fused_loss=fused)
                                     - activation_bytes(config, 0, "bf16-mixed", 1, fused_loss=fused))
    assert per_row[True, 1000] == per_row[True, 30522] == 4 * NeoBERTConfig.from_preset("tiny").hidden_size
    assert per_row[False, 30522] - per_row[False, 1000] == 12 * (30522 - 1000)


def test_the_activation_estimate_takes_the_highest_masking_rate_of_the_schedule():
    """The MLM head keeps its log-probabilities for every masked row: the peak is at the schedule's highest rate."""
    from neobert.data.tokenizer import load_tokenizer
    from neobert.instruments.preflight_memory import activation_bytes, config_activation_bytes
    from neobert.jobs.pretrain import build_model_config

    config = load_config(PretrainConfig, "neobert", ["masking.rate_schedule=[[0,0.4],[1000,0.2]]"])

    model_config = build_model_config(config, load_tokenizer(config.data.tokenizer))
    tokens = config.trainer.micro_batch_size * config.data.max_length
    # (the recipe's DeepSpeed computes in bf16 throughout: test_the_activation_widths_are_those_the_strategy_...)
    assert config_activation_bytes(config, model_config) == activation_bytes(model_config, tokens, "bf16-true",
                                                                             0.4 * tokens)


def test_the_activation_estimate_counts_what_liger_and_quack_keep_of_the_mlp(monkeypatch):
    """Per token and layer, of the MLP's 2 x ffn + ffn + ffn eager values: Liger's fused SwiGLU keeps w12's output and
    w3's input (one ffn less), QuACK's MLP w12's output only (two less). Liger compiled and QuACK in float32 run the
    eager ops: counted as eager's."""
    from neobert.data.tokenizer import load_tokenizer
    from neobert.instruments.preflight_memory import config_activation_bytes
    from neobert.jobs.pretrain import build_model_config
    from neobert.model import config as model_config_module

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)

    def estimate(*overrides):  # eager unless the overrides compile (the recipe's auto compiles on the planned H100)
        config = load_config(PretrainConfig, "neobert", ["model.compile=false", "model.compile_scope=model",
                                                         *overrides])
        return config_activation_bytes(config, build_model_config(config, load_tokenizer(config.data.tokenizer)))

    config = load_config(PretrainConfig, "neobert", [])
    model_config = build_model_config(config, load_tokenizer(config.data.tokenizer))
    ffn_values = (config.trainer.micro_batch_size * config.data.max_length * model_config.num_hidden_layers
                  * model_config.ffn_hidden_size * 2)  # bf16 under the recipe's DeepSpeed
    eager = estimate()
    assert eager - estimate("model.overrides.kernels=liger") == ffn_values
    assert eager - estimate("model.overrides.kernels=quack") == 2 * ffn_values
    compiled = ("data.packing=best_fit", "model.compile=true")
    assert estimate(*compiled, "model.overrides.kernels=liger") == estimate(*compiled)
    assert estimate(*compiled, "model.overrides.kernels=quack") == estimate(*compiled) - 2 * ffn_values
    float32 = ("trainer.precision=32-true",)
    assert estimate(*float32, "model.overrides.kernels=quack") == estimate(*float32)


@pytest.mark.parametrize("strategy, widths", [("deepspeed_stage_2", "bf16-true"), ("fsdp2", "bf16-true"),
                                              ("auto", "bf16-mixed"), ("ddp", "bf16-mixed")])
def test_the_activation_widths_are_those_the_strategy_computes_in(strategy, widths):
    """bf16-mixed keeps a float32 residual stream where the weights stay float32 under autocast (one device, DDP).
    DeepSpeed casts the module to bf16 and FSDP2 gathers bf16 parameters, whose norms run in bf16 under autocast too:
    their activations are bf16 throughout, as in bf16-true (each op keeping what it keeps there:
    test_the_activation_estimate_is_what_the_model_keeps_...)."""
    from neobert.data.tokenizer import load_tokenizer
    from neobert.instruments.preflight_memory import activation_bytes, config_activation_bytes
    from neobert.jobs.pretrain import build_model_config

    config = load_config(PretrainConfig, "neobert", [f"trainer.strategy={strategy}"])
    model_config = build_model_config(config, load_tokenizer(config.data.tokenizer))
    tokens = config.trainer.micro_batch_size * config.data.max_length
    estimate = config_activation_bytes(config, model_config)
    assert estimate == activation_bytes(model_config, tokens, widths, 0.2 * tokens)
    if widths == "bf16-true":  # no float32 norm inputs: 2 x 2 bytes less per token, layer and hidden unit
        mixed = activation_bytes(model_config, tokens, "bf16-mixed", 0.2 * tokens)
        layers, hidden = model_config.num_hidden_layers, model_config.hidden_size
        assert mixed - estimate == tokens * (2 * 2 * hidden * layers + 2 * hidden)
        text = preflight_report(load_config(PretrainConfig, "neobert", [*EIGHT_GPUS, f"trainer.strategy={strategy}"]))
        assert f"bf16-mixed, bf16-true's widths under {strategy}, the MLM head included" in text.text()


@pytest.mark.parametrize("overrides, expected", [
    ((), ["- norms, SwiGLU, RoPE in the blocks: PyTorch's eager ops",
          "- the MLM head's loss: the decoder at the masked rows, then PyTorch's cross-entropy"]),
    (("model.overrides.kernels=liger",),
     ["- norms, SwiGLU, RoPE in the blocks: Liger-Kernel's RMSNorm and fused SwiGLU (RoPE: ours)",
      "- the MLM head's loss: the decoder at the masked rows, then PyTorch's cross-entropy"]),
    (("model.overrides.kernels=liger", "model.overrides.fused_mlm_loss=true"),
     ["- the MLM head's loss: Liger's fused linear cross-entropy: no logits kept for the backward, one host read"]),
    (("data.packing=best_fit", "model.compile=true", "model.compile_scope=blocks", "model.compile_mode=reduce-overhead",
      "model.overrides.fused_mlm_loss=true"),
     ["- torch.compile, mode reduce-overhead (CUDA graphs: one batch shape, data.static_shapes): each encoder block on "
      "its own (one shared graph, but the first block's)",
      "- norms, SwiGLU, RoPE in the blocks: Inductor's fused kernels",
      "- the MLM head's loss: Liger's fused linear cross-entropy"]),
    (("data.packing=best_fit", "model.compile=true"),
     ["- torch.compile, mode default: the whole forward", "- the MLM head's loss: compiled with the forward"]),
    (("model.overrides.fused_mlm_loss=true", "model.masked_only_logits=false"),
     ["- the MLM head's loss: the decoder at every position, then PyTorch's cross-entropy (float32 log-probabilities "
      "kept); fused_mlm_loss does not apply"]),
    (("data.packing=best_fit", "model.compile=true", "model.overrides.fused_mlm_loss=true"),
     ["- the MLM head's loss: compiled with the forward (Inductor); fused_mlm_loss does not apply"]),
    (("model.overrides.kernels=quack", "model.overrides.decoder_pad_multiple=64"),
     ["- the MLP: QuACK's GEMMs, SwiGLU in their epilogues; norms and RoPE: PyTorch's eager ops",
      "then PyTorch's cross-entropy (float32 log-probabilities kept); the decoder's matmul on 30,528 rows "
      "(model.overrides.decoder_pad_multiple)"]),
    (("model.overrides.kernels=quack", "data.packing=best_fit", "model.compile=true", "model.compile_scope=blocks"),
     ["- torch.compile, mode default: each encoder block on its own (one shared graph)",
      "- the MLP: QuACK's GEMMs, SwiGLU in their epilogues; norms and RoPE: Inductor's fused kernels",
      "- the MLM head's loss: the decoder at the masked rows and PyTorch's cross-entropy, compiled on their own"]),
    (("data.packing=best_fit", "model.compile=true", "model.compile_scope=blocks", "model.masked_only_logits=false"),
     ["- the MLM head's loss: the decoder at every position, then PyTorch's cross-entropy"]),
    (("model.overrides.kernels=quack", "trainer.precision=32-true"),  # float32: the estimate counts eager's MLP
     ["- norms, SwiGLU, RoPE in the blocks: PyTorch's eager ops",
      "- model.overrides.kernels=quack does not apply: QuACK's GEMMs compute in bf16 or fp16 only, and this run "
      "computes in 32-true (trainer.precision)"]),
    (("data.packing=best_fit", "model.compile=true", "model.overrides.decoder_pad_multiple=64"),
     ["- the MLM head's loss: compiled with the forward (Inductor); the decoder's matmul on 30,528 rows"]),
    (("model.overrides.kernels=quack", "model.preset=bert-base"),  # the GELU MLP: eager whatever the choice
     ["- norms, SwiGLU, RoPE in the blocks: PyTorch's eager ops",
      "- model.overrides.kernels=quack does not apply: QuACK's MLP is a SwiGLU one; this model's is GELU"]),
])
def test_the_report_says_what_runs_the_elementwise_work_and_the_loss(tmp_path, monkeypatch, overrides, expected):
    from neobert.model import config as model_config_module

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    monkeypatch.setattr(model_config_module, "quack_missing_reason", lambda: None)
    text = preflight_report(tiny_config(tmp_path, *overrides)).text()
    assert "## Kernels and compilation" in text
    for line in expected:
        assert line in text, line


@pytest.mark.parametrize("overrides, runs", [
    (("model.overrides.fused_mlm_loss=true",), True),
    (("model.overrides.fused_mlm_loss=true", "model.masked_only_logits=false"), False),  # full logits: eager head
    (("model.overrides.fused_mlm_loss=true", "data.packing=best_fit", "model.compile=true"), False),  # compiled head
    (("model.overrides.fused_mlm_loss=true", "data.packing=best_fit", "model.compile=true",
      "model.compile_scope=blocks"), True),  # the head stays eager
    ((), False),
])
def test_the_memory_estimate_counts_the_fused_loss_only_where_the_model_runs_it(tmp_path, monkeypatch, overrides,
                                                                               runs):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.instruments.preflight_kernels import resolve_precision_on_gpu, training_plan
    from neobert.instruments.preflight_memory import activation_bytes, config_activation_bytes
    from neobert.jobs.pretrain import build_model_config
    from neobert.model import config as model_config_module

    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    config = tiny_config(tmp_path, *overrides)
    model_config = build_model_config(config, load_tokenizer(config.data.tokenizer))
    assert training_plan(config, model_config, (9, 0)).fused_loss == runs
    tokens = config.trainer.micro_batch_size * config.data.max_length
    scored = tokens * (config.masking.highest_rate if config.model.masked_only_logits else 1.0)
    assert config_activation_bytes(config, model_config) == activation_bytes(
        model_config, tokens, resolve_precision_on_gpu(config), scored, fused_loss=runs)


@pytest.mark.parametrize("overrides, states, bytes_per_parameter", [
    (("trainer.strategy=ddp", "trainer.precision=bf16-mixed"), "replicated: fp32 weights, gradients, Adam moments", 16),
    (("trainer.strategy=ddp", "trainer.precision=bf16-true"), "replicated: 16-bit weights, gradients, Adam moments", 8),
    (("trainer.strategy=ddp", "trainer.precision=bf16-mixed", "trainer.ema.decay=0.999"),
     "replicated: fp32 weights, gradients, Adam moments", 16 + 4),  # + the EMA's float32 copy
    (("trainer.strategy=ddp", "trainer.precision=bf16-true", "optimizer.name=stable_adamw"),
     "replicated: 16-bit weights, gradients, Adam moments, Kahan compensation", 10),
    (("trainer.strategy=ddp", "trainer.precision=bf16-mixed", "optimizer.name=stable_adamw"),
     "replicated: fp32 weights, gradients, Adam moments", 16),  # no compensation of float32 weights
])
def test_the_model_states_follow_the_weights_dtype_and_count_the_ema(overrides, states, bytes_per_parameter):
    from neobert.data.tokenizer import load_tokenizer
    from neobert.instruments.preflight import Preflight
    from neobert.instruments.preflight_memory import config_activation_bytes, memory_section
    from neobert.jobs.pretrain import build_model_config
    from neobert.model import NeoBERTForMaskedLM

    config = load_config(PretrainConfig, "neobert", [*EIGHT_GPUS, *overrides])
    model_config = build_model_config(config, load_tokenizer(config.data.tokenizer))
    with torch.device("meta"):
        model = NeoBERTForMaskedLM(model_config)
    parameters = sum(p.numel() for p in model.parameters())
    report = Preflight()
    total = memory_section(report, config, model, parameters, "NVIDIA H100 80GB HBM3")
    assert total == pytest.approx(bytes_per_parameter * parameters + config_activation_bytes(config, model_config))
    text = report.text()
    assert f"model states ({states} = {bytes_per_parameter - 4 * ('ema' in str(overrides))} bytes/parameter)" in text
    assert ("EMA of the weights (trainer.ema, float32): " in text) == ("trainer.ema.decay=0.999" in overrides)


@pytest.mark.parametrize("precision, width", [("bf16-mixed", 4), ("bf16-true", 2)])
def test_muons_states_are_counted_as_the_optimizer_keeps_them(precision, width):
    """Muon keeps one momentum on the hidden matrices and AdamW two moments on the rest: counted so, and equal to
    what the real optimizer holds after a step (on the tiny model here), not Adam's two everywhere."""
    from neobert.config.pretrain import OptimizerConfig
    from neobert.data.tokenizer import load_tokenizer
    from neobert.instruments.preflight import Preflight
    from neobert.instruments.preflight_memory import config_activation_bytes, memory_section
    from neobert.jobs.pretrain import build_model_config
    from neobert.lit.optim import build_muon, muon_split
    from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM

    config = load_config(PretrainConfig, "neobert", [*EIGHT_GPUS, "trainer.strategy=ddp",
                                                     f"trainer.precision={precision}", "optimizer.name=muon"])
    model_config = build_model_config(config, load_tokenizer(config.data.tokenizer))
    with torch.device("meta"):
        model = NeoBERTForMaskedLM(model_config)
    parameters = sum(p.numel() for p in model.parameters())
    hidden = sum(p.numel() for p in muon_split(model)[0].values())
    assert 0.5 * parameters < hidden < parameters  # qkv, wo, w12, w3 of the 28 blocks; not embeddings or decoder
    report = Preflight()
    total = memory_section(report, config, model, parameters, "NVIDIA H100 80GB HBM3")
    states = width * (2 * parameters + 2 * (parameters - hidden) + hidden)
    assert total == pytest.approx(states + config_activation_bytes(config, model_config))
    assert f"Muon's momentum on the {hidden / 1e6:.1f}M parameters of the hidden matrices" in report.text()
    # the formula against the optimizer itself: its states after one step, beside the weights and gradients
    tiny = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    optimizer = build_muon(tiny, OptimizerConfig(name="muon"))
    for param in tiny.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    kept = sum(t.numel() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)  # not AdamW's step counters
    tiny_parameters = sum(p.numel() for p in tiny.parameters())
    tiny_hidden = sum(p.numel() for p in muon_split(tiny)[0].values())
    assert kept == 2 * (tiny_parameters - tiny_hidden) + tiny_hidden


def test_deepspeed_stage_1_says_which_estimator_it_takes():
    pytest.importorskip("deepspeed")
    text = preflight_report(load_config(PretrainConfig, "neobert", [*EIGHT_GPUS,
                                                                    "trainer.strategy=deepspeed_stage_1"])).text()
    assert "model states (DeepSpeed's ZeRO-2 estimator, for stage 1, 8 GPUs)" in text


def test_a_float32_run_gets_no_mfu_against_a_16_bit_peak():
    text = preflight_report(load_config(PretrainConfig, "neobert", [*EIGHT_GPUS, "trainer.precision=32-true",
                                                                    "trainer.strategy=ddp"])).text()
    assert "this run computes in float32 (trainer.precision): train/mfu will not be logged" in text
    assert "dense bf16 TFLOP/s per GPU" not in text
