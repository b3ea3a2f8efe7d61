"""train/mfu: the matmul FLOPs of every token plus attention at the batches' real sequence lengths (a token attends
to its own document, so counting every token at data.max_length overstates short documents), over the peak of
the GPU named by torch (the longest PEAK_FLOPS key in its name: an H100 PCIe is not an H100 SXM)."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
from test_pretrain import tiny_config

from neobert.eval.flops import PEAK_FLOPS, attention_flops, flops_per_token, peak_flops_of
from neobert.jobs.pretrain import run_pretraining
from neobert.lit import pretrain as lit_pretrain


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("Tesla V100-SXM2-32GB", None),
    ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None),  # slower parts whose names hold the SXM parts' keys
])
def test_the_peak_of_a_gpu_by_its_name(name, peak):
    assert peak_flops_of(name) == peak
    assert PEAK_FLOPS["h100 pcie"] < PEAK_FLOPS["h100"]


def test_a_published_peak_is_for_16_bit_computation_only(monkeypatch):
    from neobert.eval import flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert flops.peak_flops(cuda, torch.bfloat16) == flops.peak_flops(cuda, torch.float16) == 989e12
    assert flops.peak_flops(cuda, torch.float32) is None  # no tensor-core bf16 rate for float32 work
    assert flops.peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_attention_over_real_lengths_is_the_per_token_formula_for_one_sequence():
    layers, hidden, weights, n = 28, 768, 200e6, 1000
    whole = n * flops_per_token(weights, layers, hidden, n, training=True)
    split = n * flops_per_token(weights, layers, hidden, 0, training=True) + attention_flops(layers, hidden, n * n,
                                                                                             training=True)
    assert split == pytest.approx(whole)
    # two documents of 500 attend within themselves: half the attention FLOPs of one of 1,000
    assert attention_flops(layers, hidden, 2 * 500**2) == pytest.approx(attention_flops(layers, hidden, n * n) / 2)


def test_train_mfu_counts_attention_at_each_batch_real_lengths(tmp_path, monkeypatch):
    peak = 1e12
    dtypes = []  # the computation the module asks a peak for: its precision's (tiny_config: float32)
    monkeypatch.setattr(lit_pretrain, "peak_flops", lambda device, dtype: dtypes.append(dtype) or peak)  # as on a GPU

    class Lengths(L.Callback):
        per_step: list = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            cu = batch["cu_seqlens"]
            self.per_step.append((cu[1:] - cu[:-1]).tolist())

    lengths = Lengths()
    # documents of varied length, most shorter than data.max_length
    config = tiny_config(tmp_path, "trainer.max_steps=4", "model.overrides.max_length=1024", "data.max_length=1024")
    module_flops = {}

    class Flops(L.Callback):
        def on_train_start(self, trainer, module):
            module_flops.update(matmul=module.matmul_flops_per_token,
                                attention=module.attention_flops_per_squared_length,
                                layers=module.model.config.num_hidden_layers, hidden=module.model.config.hidden_size)

    run_pretraining(config, [lengths, Flops()])
    with open(next((tmp_path / "run" / "logs").glob("version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/mfu")]
    assert len(rows) == 3  # steps 2..4: the first interval has no start time
    max_length = config.data.max_length
    for row in rows:
        step = int(row["step"])
        docs = lengths.per_step[step]
        tokens, squares = sum(docs), sum(n * n for n in docs)
        assert squares < tokens * max_length  # short documents: less attention than at data.max_length
        per_token = module_flops["matmul"] + module_flops["attention"] * squares / tokens
        assert float(row["train/mfu"]) == pytest.approx(float(row["train/tokens_per_sec"]) * per_token / peak,
                                                        rel=1e-6)  # the CSV holds float32
        at_max_length = flops_per_token(0, module_flops["layers"], module_flops["hidden"], max_length, True)
        assert module_flops["attention"] * squares / tokens < at_max_length
    assert dtypes and set(dtypes) == {torch.float32}  # tiny_config trains in 32-true: on a GPU, no train/mfu
