"""InfoNCE: a hand computation, hard negatives, Matryoshka, the cross-process gather (2 gloo processes), and
GradCache (with Matryoshka too)."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from neobert.config.contrastive import ContrastiveConfig, ContrastiveLossConfig
from neobert.config import ConfigError
from neobert.lit.contrastive import ContrastiveModule, distributed_info_nce, info_nce, matryoshka_info_nce


def test_info_nce_matches_a_hand_computation_on_3x3():
    queries = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    positives = torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, -1.0]])
    # Cosines by hand: q0=(1,0), q1=(0,1), q2=(.6,.8); p0=(1,0), p1=(1,1)/sqrt2, p2=(0,-1).
    r = 1 / math.sqrt(2)
    cosines = [[1.0, r, 0.0], [0.0, r, -1.0], [0.6, 0.6 * r + 0.8 * r, -0.8]]
    t = 0.07
    expected = 0.0
    for i, row in enumerate(cosines):
        expected += -(row[i] / t - math.log(sum(math.exp(c / t) for c in row)))
    expected /= 3
    assert info_nce(queries, positives, temperature=t).item() == pytest.approx(expected, rel=1e-5)


def test_hard_negatives_enter_every_denominator():
    torch.manual_seed(0)
    queries, positives = torch.randn(4, 8), torch.randn(4, 8)
    far = -queries  # cosine -1 with its own query: contributes exp(-1/t), almost nothing
    near = queries + 0.01 * torch.randn(4, 8)  # cosine ~1: a hard negative as close as it gets
    base = info_nce(queries, positives)
    with_far, with_near = info_nce(queries, positives, far), info_nce(queries, positives, near)
    assert base < with_far < with_near
    # By hand: loss_i = -log(e^{s_ii} / (sum_j e^{s_ij} + sum_k e^{n_ik})), negatives shared by all queries.
    q = torch.nn.functional.normalize(queries, dim=-1)
    s = q @ torch.nn.functional.normalize(positives, dim=-1).T / 0.07
    n = q @ torch.nn.functional.normalize(near, dim=-1).T / 0.07
    expected = -(s.diag() - torch.logsumexp(torch.cat([s, n], dim=1), dim=1)).mean()
    assert with_near.item() == pytest.approx(expected.item(), rel=1e-5)


def test_matryoshka_loss_is_the_weighted_sum_of_infonce_on_each_truncation_by_hand():
    torch.manual_seed(0)
    queries, positives, negatives = torch.randn(5, 16), torch.randn(5, 16), torch.randn(10, 16)
    weights = {16: 1.0, 8: 0.5, 4: 2.0}

    def by_hand(d: int) -> float:  # explicit cosines of the first d dimensions, one query at a time
        total = 0.0
        candidates = torch.cat([positives, negatives])[:, :d]
        for i in range(5):
            q = queries[i, :d] / queries[i, :d].norm()
            scores = [float(q @ (c / c.norm())) / 0.07 for c in candidates]
            total += -(scores[i] - math.log(sum(math.exp(x) for x in scores)))
        return total / 5

    loss, parts = matryoshka_info_nce(queries, positives, negatives, 0.07, weights)
    assert set(parts) == {16, 8, 4}
    for d in weights:
        assert parts[d].item() == pytest.approx(by_hand(d), rel=1e-5)
    assert loss.item() == pytest.approx(sum(w * by_hand(d) for d, w in weights.items()), rel=1e-5)
    # One dimension equal to the embedding size is plain InfoNCE; truncation is not a no-op.
    assert matryoshka_info_nce(queries, positives, negatives, 0.07, {16: 1.0})[0].item() == pytest.approx(
        info_nce(queries, positives, negatives).item(), rel=1e-6)
    assert parts[4].item() != pytest.approx(parts[16].item(), rel=1e-3)


def test_matryoshka_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"loss\.matryoshka_dims"):
        ContrastiveLossConfig(matryoshka_dims=[64, 64]).validate()
    with pytest.raises(ConfigError, match=r"loss\.matryoshka_weights"):
        ContrastiveLossConfig(matryoshka_dims=[64, 32], matryoshka_weights=[1.0]).validate()
    with pytest.raises(ConfigError, match=r"loss\.matryoshka_dims.*\[1024\].*512"):
        ContrastiveLossConfig(matryoshka_dims=[1024, 256]).dimension_weights(512)
    assert ContrastiveLossConfig(matryoshka_dims=[512, 256]).dimension_weights(512) == {512: 1.0, 256: 1.0}
    assert ContrastiveLossConfig().dimension_weights(384) == {384: 1.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Plain InfoNCE (the whole 6-dimensional embedding) and Matryoshka over 6, 3 and 2 dimensions.
GATHER_CASES = {"infonce": {6: 1.0}, "matryoshka": {6: 1.0, 3: 0.5, 2: 2.0}}


def _gathered_worker(rank: int, world: int, port: int, tensors: dict, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        per_rank = tensors["q"].shape[0] // world
        for case, weights in GATHER_CASES.items():
            local = {k: v[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
                     for k, v in tensors.items()}
            loss, _ = distributed_info_nce(local["q"], local["p"], local["n"], 0.07, weights)
            loss.backward()
            results[(case, rank)] = (loss.item(), {k: v.grad.clone() for k, v in local.items()})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawning two processes that import torch takes ~30-50 s on a shared 2-core machine
def test_gathered_negatives_equal_the_loss_on_the_concatenated_batch():
    """Two gloo processes, each with half the batch: the mean of their losses is the single-process loss on the
    whole batch, and each process's embedding gradients are the whole-batch gradients times the world size
    (DDP divides parameter gradients by it), because the gather carries gradients back across processes. The
    same holds for the Matryoshka loss, whose truncations slice the gathered embeddings."""
    torch.manual_seed(0)
    world = 2
    tensors = {"q": torch.randn(6, 6), "p": torch.randn(6, 6), "n": torch.randn(6, 6)}
    results = mp.Manager().dict()
    mp.start_processes(_gathered_worker, args=(world, _free_port(), tensors, results), nprocs=world,
                       start_method="spawn")
    for case, weights in GATHER_CASES.items():
        full = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        full_loss, _ = matryoshka_info_nce(full["q"], full["p"], full["n"], 0.07, weights)
        full_loss.backward()
        losses = [results[(case, r)][0] for r in range(world)]
        assert sum(losses) / world == pytest.approx(full_loss.item(), rel=1e-5), case
        # A process that saw only its own half (no gather) would have a different loss.
        alone, _ = matryoshka_info_nce(tensors["q"][:3], tensors["p"][:3], tensors["n"][:3], 0.07, weights)
        assert alone.item() != pytest.approx(losses[0], rel=1e-3), case
        for rank in range(world):
            for key in ("q", "p", "n"):
                grad = results[(case, rank)][1][key] / world
                torch.testing.assert_close(grad, full[key].grad[rank * 3:(rank + 1) * 3], rtol=1e-5, atol=1e-6,
                                           msg=f"{case} {key}")
    matryoshka = [results[("matryoshka", r)][0] for r in range(world)]
    assert matryoshka != [results[("infonce", r)][0] for r in range(world)]


def _batch(vocab: int, size: int, length: int, generator) -> dict:
    ids = torch.randint(5, vocab, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.long)
    mask[::2, length // 2:] = 0  # padded rows: pooling must respect the mask in both paths
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("dropout_on, chunk_size, matryoshka_dims", [(False, 4, []), (True, 6, []),
                                                                    (False, 4, [64, 32, 8]), (True, 6, [16, 64])])
def test_grad_cache_gives_the_same_gradients_as_one_backward(dropout_on, chunk_size, matryoshka_dims):
    """Chunked GradCache accumulates the gradients of one ordinary backward, with plain InfoNCE and with the
    Matryoshka loss. With dropout on and one chunk per side, both paths draw the same masks only if GradCache
    replays each chunk's RNG state when re-embedding."""
    from neobert.data.backbone import Backbone
    from neobert.model.config import NeoBERTConfig
    from neobert.model.modeling import NeoBERT

    encoder = NeoBERT(NeoBERTConfig.from_preset("tiny", vocab_size=200, max_length=32, dropout=0.1))
    encoder.train(dropout_on)
    generator = torch.Generator().manual_seed(0)
    batch = {side: _batch(200, 6, 12, generator) for side in ("query", "positive", "negative")}

    def grads(chunk: int) -> dict[str, torch.Tensor]:
        config = ContrastiveConfig(loss=ContrastiveLossConfig(grad_cache_chunk_size=chunk,
                                                              matryoshka_dims=matryoshka_dims))
        module = ContrastiveModule(Backbone(encoder, None, 64, 2, True), config.loss, config.optimizer,
                                   config.scheduler, config.trainer)
        module.zero_grad()
        torch.manual_seed(1)
        if chunk:
            module.manual_backward = lambda loss: loss.backward()  # no Trainer in this unit test
            losses[chunk] = module.grad_cache_backward(batch)
        else:
            losses[chunk] = module._loss_from_embeddings({s: module.embed(**inputs) for s, inputs in batch.items()})
            losses[chunk][0].backward()
        return {name: p.grad.clone() for name, p in module.named_parameters()}

    losses = {}
    reference, cached = grads(0), grads(chunk_size)
    assert losses[chunk_size][0].item() == pytest.approx(losses[0][0].item(), rel=1e-5)
    assert set(losses[chunk_size][1]) == set(matryoshka_dims or [64])
    assert reference.keys() == cached.keys()
    for name in reference:
        torch.testing.assert_close(cached[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in cached.values())
