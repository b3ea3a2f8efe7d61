"""data.static_shapes: packed batches of one shape, so that a compiled model traces one graph for the whole run. With
best_fit packing every batch had its own token count, cu_seqlens length, longest document and masked_index length,
and torch.compile recompiled for each new shape: on a GPU a run stalled. The padding must change nothing but the
shapes: the same tokens, masks, loss, accuracy and gradients as the unpadded packed batch."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
import torch._dynamo
from test_data_pretraining import corpus, tokenizer  # noqa: F401 - the shared fixtures
from torch._dynamo.testing import CompileCounter

from neobert.config import ConfigError, load_config
from neobert.config.pretrain import MaskingConfig, PretrainConfig, PretrainDataConfig
from neobert.data.demo_corpus import demo_documents
from neobert.data.masking import IGNORE_INDEX, MLMMasker, StaticShapes, static_shapes_for
from neobert.data.packing import BestFitPacker
from neobert.data.pretraining import PretrainingStream
from neobert.errors import DataError
from neobert.jobs.phases import phase_config
from neobert.lit.pretrain import MLMPretrainingModule
from neobert.model import NeoBERTConfig

ROWS, LENGTH = 4, 128  # best fit leaves rows of 128 tokens short, so unpadded batches differ in every shape
TENSORS = ("input_ids", "labels", "cu_seqlens", "masked_index")




def packed_batches(corpus, tokenizer, static_shapes: str, count: int = 20) -> list[dict]:
    data = PretrainDataConfig(source=str(corpus), max_length=LENGTH, shuffle_buffer=50, num_workers=0,
                              packing="best_fit", static_shapes=static_shapes)
    return list(itertools.islice(iter(PretrainingStream(data, MaskingConfig(), tokenizer, ROWS)), count))


def shapes(batch: dict) -> dict:
    return {**{key: tuple(batch[key].shape) for key in TENSORS}, "max_seqlen": batch["max_seqlen"]}


def document_lengths(batch: dict) -> list[int]:
    return torch.diff(batch["cu_seqlens"]).tolist()


def test_every_static_packed_batch_of_the_stream_has_one_shape(corpus, tokenizer):
    static, unpadded = packed_batches(corpus, tokenizer, "true"), packed_batches(corpus, tokenizer, "false")
    assert len({str(shapes(batch)) for batch in unpadded}) > 5  # the case under test: every batch its own shapes
    expected = StaticShapes.for_packed_rows(ROWS, LENGTH, 0, MaskingConfig().highest_rate)
    assert expected.documents == ROWS * 8  # the default: max(8, 128 // 32) documents per row
    for batch, plain in zip(static, unpadded):
        assert shapes(batch) == {"input_ids": (ROWS, LENGTH), "labels": (ROWS, LENGTH),
                                 "cu_seqlens": (expected.documents + 1,), "masked_index": (expected.masked,),
                                 "max_seqlen": LENGTH}
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"][-1] == ROWS * LENGTH
        # The same tokens and masks, [PAD] (label -100) only after them.
        ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
        real = ids != tokenizer.pad_token_id
        assert torch.equal(ids[real], plain["input_ids"].reshape(-1))
        assert torch.equal(labels[real], plain["labels"].reshape(-1)) and (labels[~real] == IGNORE_INDEX).all()
        # Documents: the unpadded batch's, in order, then [PAD]-only ones, then zero-length ones; none crosses a row.
        lengths, starts = document_lengths(batch), batch["cu_seqlens"][:-1].tolist()
        kinds = ["empty" if n == 0 else "real" if real[s : s + n].all() else "pad" if not real[s : s + n].any()
                 else "mixed" for s, n in zip(starts, lengths)]
        assert [n for kind, n in zip(kinds, lengths) if kind == "real"] == document_lengths(plain)
        assert "mixed" not in kinds and set(kinds[kinds.index("empty") :]) == {"empty"}
        assert batch["documents"] == kinds.index("empty")  # how many are not filler
        assert all(s // LENGTH == (s + n - 1) // LENGTH for s, n in zip(starts, lengths) if n)
        # masked_index: the masked positions, then a position labelled -100; the same targets in the same order.
        targets = labels[batch["masked_index"]]
        scored = targets != IGNORE_INDEX
        assert torch.equal(targets[scored], plain["labels"].reshape(-1)[plain["masked_index"]])
        assert not scored[int(scored.sum()) :].any()


def test_a_compiled_model_traces_one_graph_for_twenty_static_batches(corpus, tokenizer):
    """Forward and backward, as the training step runs them, over 20 batches of the real stream: one frame
    compiled, no recompilation, though their number of documents differs (the module marks it dynamic). Without
    that mark, and the unpadded batches, for contrast, recompile."""
    config = NeoBERTConfig.from_preset("tiny", vocab_size=len(tokenizer), max_length=LENGTH,
                                       attention_backend="varlen")

    def compiled_frames(batches: list[dict], compiled_run: bool = True, scope: str = "model") -> int:
        recipe = PretrainConfig()
        recipe.model.compile = compiled_run
        module = MLMPretrainingModule(recipe, config, tokenizer)  # its forward is the training step's
        torch._dynamo.reset()
        counter = CompileCounter()
        module.model.compile(backend=counter, fullgraph=True, scope=scope)
        for batch in batches:
            module.model.zero_grad(set_to_none=True)
            module(batch).loss.backward()
        return counter.frame_count

    static = packed_batches(corpus, tokenizer, "true")
    assert len({batch["documents"] for batch in static}) > 1
    assert compiled_frames(static) == 1
    assert compiled_frames(static[:4], compiled_run=False) > 1
    # Each block on its own: the CPU's attention (padded_sdpa) also takes a per-document mask built outside the
    # blocks, so each compiles twice (the second time with the count dynamic), and never fails on the count.
    assert compiled_frames(static, scope="blocks") <= 2 * config.num_hidden_layers
    assert compiled_frames(packed_batches(corpus, tokenizer, "false", count=4)) > 1


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_model_gets_the_real_documents_unless_cuda_graphs_replay_the_step(tokenizer, mode):
    """The zero-length filler documents of a static batch reach the model only under CUDA graphs (fixed shapes):
    elsewhere each would cost the attention kernel a block per head for nothing."""
    config = NeoBERTConfig.from_preset("tiny", vocab_size=len(tokenizer), max_length=LENGTH,
                                       attention_backend="varlen")
    recipe = PretrainConfig()
    recipe.model.compile_mode = mode
    module = MLMPretrainingModule(recipe, config, tokenizer)
    masker = MLMMasker.from_tokenizer(tokenizer, static=StaticShapes.for_packed_rows(ROWS, LENGTH, 0, 0.2))
    batch = masker.collate_packed(_rows(tokenizer), torch.Generator().manual_seed(0))
    assert batch["cu_seqlens"].numel() == ROWS * 8 + 1 > batch["documents"] + 1
    seen = []
    module.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["cu_seqlens"]),
                                           with_kwargs=True)
    with torch.no_grad(), mock.patch.object(torch.compiler, "cudagraph_mark_step_begin"):
        module(batch)
    expected = batch["cu_seqlens"] if mode == "reduce-overhead" else batch["cu_seqlens"][: batch["documents"] + 1]
    assert torch.equal(seen[0], expected)


def _rows(tokenizer) -> list:
    """Best-fit rows of real documents, of unequal lengths (an unpadded batch of one row of all their tokens)."""
    packer = BestFitPacker(LENGTH, open_rows=8)
    for document in demo_documents()[:40]:
        packer.add(tokenizer(document["content"])["input_ids"])
    packer.flush()
    rows = packer.take(ROWS)
    assert len({sum(map(len, row)) for row in rows}) > 1
    return rows


@pytest.mark.parametrize("strategy", ["all_mask", "bert"])
def test_padding_changes_nothing_but_the_shapes(tokenizer, strategy):
    torch.manual_seed(0)
    config = NeoBERTConfig.from_preset("tiny", vocab_size=len(tokenizer), max_length=LENGTH,
                                       attention_backend="varlen")
    module = MLMPretrainingModule(PretrainConfig(), config, tokenizer).train()
    static = StaticShapes.for_packed_rows(ROWS, LENGTH, 0, 0.3)
    rows = _rows(tokenizer)
    batches = {name: MLMMasker.from_tokenizer(tokenizer, 0.3, strategy, static=shape).collate_packed(
        rows, torch.Generator().manual_seed(7)) for name, shape in (("unpadded", None), ("static", static))}
    assert batches["static"]["input_ids"].numel() > batches["unpadded"]["input_ids"].numel()

    results = {}
    for name, batch in batches.items():
        module.model.zero_grad(set_to_none=True)
        output = module(batch)
        output.loss.backward()
        targets = batch["labels"].reshape(-1)[output.masked_index]
        scored = targets != IGNORE_INDEX
        results[name] = (output.loss.detach(), int(((output.logits.argmax(-1) == targets) & scored).sum()),
                         int(scored.sum()), {n: p.grad.clone() for n, p in module.model.named_parameters()})
    (loss, correct, masked, grads), (static_loss, static_correct, static_masked, static_grads) = results.values()
    torch.testing.assert_close(static_loss, loss, atol=1e-5, rtol=1e-5)
    assert (static_correct, static_masked) == (correct, masked) and masked > 0
    for name in grads:
        torch.testing.assert_close(static_grads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)
    # The eager checks of a model that validates its inputs accept the zero-length documents.
    module.model.set_validate_inputs(True)
    with torch.no_grad():
        checked = module(batches["static"]).loss
    torch.testing.assert_close(checked, static_loss, atol=1e-5, rtol=1e-5)


def test_the_training_accuracy_counts_only_real_masked_tokens(tokenizer):
    config = NeoBERTConfig.from_preset("tiny", vocab_size=len(tokenizer), max_length=LENGTH)
    module = MLMPretrainingModule(PretrainConfig(), config, tokenizer)
    masker = MLMMasker.from_tokenizer(tokenizer, static=StaticShapes.for_packed_rows(ROWS, LENGTH, 0, 0.2))
    batch = masker.collate_packed(_rows(tokenizer), torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, masked = module._accuracy_counts(module(batch), batch["labels"])
    assert int(masked) == int((batch["labels"] != IGNORE_INDEX).sum())


# ---------------------------------------------------------------------------------------------- limits
def _masker(tokenizer, static: StaticShapes) -> MLMMasker:
    return MLMMasker.from_tokenizer(tokenizer, rate=0.5, static=static)


def test_a_batch_with_more_documents_than_the_bound_fails_naming_the_key(tokenizer):
    rows = [[[101, 2000, 102], [101, 2001, 102], [101, 2002, 102]], [[101, 2003, 2004, 102]]]  # 3 + pad, 1 + pad
    _masker(tokenizer, StaticShapes(rows=2, length=16, documents=6, masked=32)).collate_packed(rows)
    with pytest.raises(DataError, match=r"6 documents .*data.static_documents_per_row=2 allows in 2 rows .* set "
                                        r"data.static_documents_per_row to 3 or more"):
        _masker(tokenizer, StaticShapes(rows=2, length=16, documents=4, masked=32)).collate_packed(rows)


def test_a_batch_of_more_rows_than_the_static_shape_keeps_its_own(tokenizer):
    """Validation's last batch holds every row still open (up to data.packing_open_rows more than a micro-batch)."""
    rows = [[[101, 2000 + row, 102]] for row in range(5)]
    static = _masker(tokenizer, StaticShapes(rows=4, length=16, documents=8, masked=32)).collate_packed(
        rows, torch.Generator().manual_seed(0))
    plain = _masker(tokenizer, None).collate_packed(rows, torch.Generator().manual_seed(0))
    assert static.keys() == plain.keys() and static["max_seqlen"] == plain["max_seqlen"] == 3
    assert all(torch.equal(static[key], plain[key]) for key in TENSORS)


def test_masked_positions_beyond_the_fixed_count_are_unmasked(tokenizer):
    rows = [[[101] + list(range(2000, 2030)) + [102]]]
    plain = _masker(tokenizer, None).collate_packed(rows, torch.Generator().manual_seed(1))
    assert plain["masked_index"].numel() > 4  # rate 0.5 over 30 maskable tokens
    batch = _masker(tokenizer, StaticShapes(rows=1, length=32, documents=2, masked=4)).collate_packed(
        rows, torch.Generator().manual_seed(1))
    kept = plain["masked_index"][:4]  # the first four stay masked; the others get their own token back
    assert torch.equal(batch["masked_index"], kept)
    assert torch.equal((batch["labels"].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1), kept)
    expected = torch.tensor(rows[0][0])
    expected[kept] = tokenizer.mask_token_id
    assert torch.equal(batch["input_ids"].reshape(-1), expected)


# ---------------------------------------------------------------------------------------------- the key
def test_static_shapes_key_auto_follows_model_compile_and_is_checked():
    for compile_, expected in ((True, "true"), (False, "false")):
        config = PretrainConfig()
        config.model.compile = compile_
        config.resolve()
        assert config.data.static_shapes == expected
        config.validate()
    config = PretrainConfig()
    config.data.static_shapes = "False"  # what YAML's false becomes in a str field
    config.resolve()
    assert config.data.static_shapes == "false"
    config.validate()
    for key, value in (("static_shapes", "sometimes"), ("static_documents_per_row", -1)):
        config = PretrainConfig()
        setattr(config.data, key, value)
        config.resolve()
        with pytest.raises(ConfigError, match=f"data.{key}"):
            config.validate()
    config = PretrainConfig()
    config.data.static_shapes = "Sometimes"
    config.resolve()  # left as given, for validate to name as the user wrote it
    with pytest.raises(ConfigError, match=r"data.static_shapes.*got 'Sometimes'"):
        config.validate()


def test_static_shapes_auto_is_resolved_at_load_and_per_phase():
    for compile_, expected in (("true", "true"), ("false", "false")):
        config = load_config(PretrainConfig, None, [f"model.compile={compile_}", "data.packing=greedy"])
        assert config.data.static_shapes == expected
    # a phase that sets auto again gets model.compile's value, whatever its packing
    config = load_config(PretrainConfig, None, [
        "model.compile=true", "data.static_shapes=false", "trainer.max_steps=4",
        "phases=[{name: a, steps: 2}, {name: b, overrides: {data.packing: best_fit, data.static_shapes: auto}}]"])
    assert [phase_config(config, i).data.static_shapes for i in range(2)] == ["false", "true"]


def test_static_shapes_apply_to_packed_batches_only():
    masking = MaskingConfig(rate=0.2, rate_schedule=[[0, 0.3], [100, 0.1]])
    data = PretrainDataConfig(packing="best_fit", static_shapes="true", max_length=1024)
    static = static_shapes_for(data, masking, 32)
    assert static == StaticShapes.for_packed_rows(32, 1024, 0, 0.3)  # the schedule's highest rate
    assert static.documents == 32 * 32 and 0.3 * 32 * 1024 < static.masked < 0.32 * 32 * 1024
    assert static_shapes_for(PretrainDataConfig(packing="none", static_shapes="true"), masking, 32) is None
    assert static_shapes_for(PretrainDataConfig(packing="greedy", static_shapes="false"), masking, 32) is None
    assert static_shapes_for(PretrainDataConfig(packing="greedy", static_shapes="auto"), masking, 32) is None


def test_a_static_run_logs_the_real_tokens_and_accuracy(tmp_path):
    """The step metrics of static batches count real tokens, not the [PAD] tails that fill each row (train/tokens,
    tokens/s, MFU and the packing efficiency read stats["tokens"]), and accuracy over real masked tokens only."""
    from test_pretrain import tiny_config

    from neobert.eval.plots import read_curves
    from neobert.jobs.pretrain import run_pretraining
    from neobert.layout import metrics_csvs

    keys = ["train/packing_efficiency", "train/accuracy"]
    curves = {}
    for static in ("true", "false"):
        config = tiny_config(tmp_path / static, "data.packing=best_fit", f"data.static_shapes={static}",
                             "model.overrides.max_length=256", "data.max_length=256",  # rows of whole documents
                             "trainer.max_steps=3")
        run_pretraining(config)
        curves[static] = read_curves(metrics_csvs(config.output_dir), keys)
    # The same documents and masks either way: the same packing efficiency and
    # the same accuracy at the first step (the weights have not yet diverged).
    efficiency = curves["true"]["train/packing_efficiency"]
    assert efficiency == pytest.approx(curves["false"]["train/packing_efficiency"])
    assert min(efficiency.values()) < 1  # a step whose rows end short: counted with its [PAD] tails it reads 1
    first = min(curves["true"]["train/accuracy"])
    assert curves["true"]["train/accuracy"][first] == pytest.approx(curves["false"]["train/accuracy"][first])
