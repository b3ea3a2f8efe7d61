"""The model's forward + MLM loss is one graph under `torch.compile(fullgraph=True)`, padded and packed, on both
attention backends: no graph break, so no host synchronisation inside it (on a GPU every break or `.item()`
stalls the pipeline; this is the part of the GPU path that can be checked on a CPU). Compiled, value checks of
the inputs are skipped (they would read the device on the host); eager keeps them."""

import copy
import math
import pickle

import pytest
import torch
import torch._dynamo

from neobert.data.masking import masked_index
from neobert.model import NeoBERTConfig, NeoBERTForMaskedLM
from neobert.model import config as model_config_module


def batch(vocab_size: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab_size, (2, 16), generator=generator)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, 10:] = 0
    labels = torch.full_like(input_ids, -100)
    labels[:, 3] = input_ids[:, 3]
    labels[0, 7] = input_ids[0, 7]
    return input_ids, attention_mask, labels


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("logits", ["all", "masked_index"])
def test_forward_and_loss_compile_without_graph_breaks(backend, layout, logits):
    """`masked_index` (the collator's flat indices of the masked positions) keeps the masked-only logits in the
    graph; the boolean search of `masked_only=True` would need a data-dependent shape."""
    torch.manual_seed(0)
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", attention_backend=backend)).eval()
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    cu_seqlens = torch.tensor([0, 5, 16, 32], dtype=torch.int32)
    masked = {"masked_index": masked_index(labels)} if logits == "masked_index" else {}

    def loss(input_ids, attention_mask, labels, cu_seqlens):
        if layout == "packed":
            return model(input_ids, labels=labels, cu_seqlens=cu_seqlens, max_seqlen=16, **masked).loss
        return model(input_ids, attention_mask, labels=labels, **masked).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(input_ids, attention_mask, labels, cu_seqlens)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="eager")  # fullgraph: a break would raise
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids, attention_mask, labels, cu_seqlens),
                                   loss(input_ids, attention_mask, labels, cu_seqlens))


def test_masked_index_gives_the_masked_only_loss_and_logits():
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).eval()
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    with torch.no_grad():
        by_search = model(input_ids, attention_mask, labels=labels, masked_only=True)
        by_index = model(input_ids, attention_mask, labels=labels, masked_index=masked_index(labels))
        full = model(input_ids, attention_mask, labels=labels)
    torch.testing.assert_close(by_index.logits, by_search.logits)
    torch.testing.assert_close(by_index.loss, full.loss)
    assert by_index.logits.shape[0] == 3  # the three masked positions of `batch`, row-major


def test_eager_still_checks_values():
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).eval()
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="token ids must be in"):
        model(input_ids + model.config.vocab_size, attention_mask)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        model(input_ids, cu_seqlens=torch.tensor([0, 5, 30], dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        model(input_ids, attention_mask, cu_seqlens=torch.tensor([0, 16, 32], dtype=torch.int32))


def test_the_compiled_graph_holds_no_complex_tensor():
    """Inductor has no code generation for complex arithmetic (the eager RoPE's): it would fall back to slow code."""
    dtypes = []

    def recording_backend(graph_module, example_inputs):
        dtypes.extend(node.meta["example_value"].dtype for node in graph_module.graph.nodes
                      if isinstance(node.meta.get("example_value"), torch.Tensor))
        return graph_module.forward

    torch._dynamo.reset()
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).eval()
    input_ids, attention_mask, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend=recording_backend)(input_ids, attention_mask)
    assert torch.float32 in dtypes and not any(dtype.is_complex for dtype in dtypes)


def graph_keeping_backend(graphs: list):
    """A torch.compile backend that keeps each graph it is handed in `graphs` and runs it as traced."""
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_compiled_on_their_own_share_one_graph_per_shape(dtype):
    """compile_scope=blocks: every block runs one graph. The compiled rotation's tables are made before the first
    block: made by it, they were a side effect of its graph and a guard (`not rope._interleaved`) that gave the first
    block a graph of its own (measured on CPU, 2026-11-26: 4 graphs over two token counts in training, against 2).
    Not under CUDA graphs: there tables made before the blocks would be an input that each block's graph copies into
    a buffer of its own at every replay, where the first block's output stays in place."""
    graphs = []
    counting_backend = graph_keeping_backend(graphs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).to(dtype).eval()
    model.set_validate_inputs(False)
    input_ids, attention_mask, _ = batch(model.config.vocab_size)
    with torch.no_grad():
        expected = model.model(input_ids, attention_mask).last_hidden_state
        model.compile(scope="blocks", backend=counting_backend)
        got = model.model(input_ids, attention_mask).last_hidden_state
    assert len(model.model.transformer_encoder) == 2 and len(graphs) == 1
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # compiled RoPE computes in float32, eager bf16 in bf16
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    for mode, first in (("reduce-overhead", False), ("max-autotune", False), ("max-autotune-no-cudagraphs", True)):
        model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
        model.compile(scope="blocks", mode=mode)  # lazy: nothing is traced until a block runs
        assert model.model.rotation_tables_first is first, mode


def test_blocks_compile_the_mlm_heads_scoring_too_dynamic_in_its_rows_and_equal_to_eager(monkeypatch):
    """compile_scope=blocks compiles the MLM head's decoder and loss over the masked rows as well (the float32 logits
    fused into the cross-entropy): one graph for every count of masked rows, the loss and every gradient as eager's.
    Never under CUDA graphs (a graph's pool would keep the logits until the next replay overwrites them), and not
    where fused_mlm_loss fuses the head its own way."""
    graphs = []
    counting_backend = graph_keeping_backend(graphs)

    def step(model, rows):
        model.zero_grad(set_to_none=True)
        labels = torch.full_like(input_ids, -100)
        labels.view(-1)[rows] = input_ids.view(-1)[rows]
        out = model(input_ids, labels=labels, masked_index=rows)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny"))
    model.set_validate_inputs(False)
    input_ids = torch.randint(5, model.config.vocab_size, (2, 32))
    row_sets = [torch.arange(0, 64, 5), torch.arange(1, 64, 3), torch.arange(2, 64, 7)]  # 13, 21 and 9 masked rows
    expected = [step(model, rows) for rows in row_sets]
    model.compile(scope="blocks", backend=counting_backend)
    got = [step(model, rows) for rows in row_sets]
    scoring = [graph for graph in graphs if "cross_entropy" in graph.code]
    assert len(scoring) == 1 and len(graphs) == 2  # the head's, dynamic in its rows, and the blocks' one
    for (loss, logits, grads), (want_loss, want_logits, want_grads) in zip(got, expected):
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        for grad, want in zip(grads, want_grads):
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5)

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    for mode, head in (("reduce-overhead", {"dynamic": False, "mode": "default"}),  # CUDA graphs: static batches
                       ("max-autotune", {"dynamic": False, "mode": "max-autotune-no-cudagraphs"}),
                       ("default", {"dynamic": True, "mode": "default"}), (None, {"dynamic": True, "mode": None})):
        calls.clear()
        NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).compile(scope="blocks", mode=mode)
        assert all(kwargs["mode"] == mode for kwargs in calls[:-1]) and len(calls) == 3  # two blocks, then the head
        assert calls[-1] == head, mode
    calls.clear()
    NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny")).compile(scope="blocks", mode="default", dynamic=False)
    assert calls[-1] == {"dynamic": False, "mode": "default"}  # a caller's static shapes (gpu_check's ceiling)
    monkeypatch.setattr(model_config_module, "liger_missing_reason", lambda: None)
    calls.clear()
    fused = NeoBERTForMaskedLM(NeoBERTConfig.from_preset("tiny", fused_mlm_loss=True))
    fused.compile(scope="blocks")
    assert len(calls) == 2 and "score_masked_rows" not in vars(fused)  # the blocks only: Liger fuses the head
    monkeypatch.undo()
    # a copy or a pickle of the compiled model runs its own weights through the eager method (the compiled one is
    # bound to the original), as nn.Module's own compiled call is dropped
    copied = copy.deepcopy(model)
    assert "score_masked_rows" not in vars(copied) and "score_masked_rows" in vars(model)
    with torch.no_grad():
        copied.decoder.weight.zero_()
        copied.decoder.bias.zero_()
    labels = torch.full_like(input_ids, -100)
    labels.view(-1)[row_sets[0]] = input_ids.view(-1)[row_sets[0]]
    uniform = copied(input_ids, labels=labels, masked_index=row_sets[0]).loss
    torch.testing.assert_close(uniform, torch.tensor(math.log(model.config.vocab_size)))
    assert "score_masked_rows" not in vars(pickle.loads(pickle.dumps(model)))
