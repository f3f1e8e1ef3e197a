"""Dropout under tensor parallelism: each rank keeps its chunk of the mask TP=1 draws.

Attention dropout acts on each rank's own heads and, under sequence parallelism, hidden dropout on
each rank's own tokens: those masks must be independent draws across the ranks. Hidden dropout on
the replicated residual stream must be the same on every rank. Every dropout drawing its chunk of
the whole tensor's mask from the default generator (identical across the group) gives both, and
more: the TP=2 model with dropout on computes what the TP=1 model computes, loss and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from swbert.models.attention import SDPAKernel
from swbert.parallel import gather_tensors, initialize, parallelize
from swbert.parallel.layers import ShardedDropout, TensorParallelKernel
from tests.parallel.test_parallel_harness import mlm_batch, reference_model, run_ranks, tiny_config

P = 0.1


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _masks_are_tp1s_chunks() -> None:
    d = initialize(2, seed=0)
    B, H, S, Dh = 2, 4, 16, 8
    g = torch.Generator().manual_seed(3)  # the same full tensors on both ranks
    q, k, v = (torch.randn(B, H, S, Dh, generator=g) for _ in range(3))
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[-1, ..., S // 2 :] = False  # key padding in the last sequence
    mine = slice(d.tp_rank * H // 2, (d.tp_rank + 1) * H // 2)  # this rank's heads

    # attention dropout: the ranks' masks on their heads differ, and together are TP=1's
    dropout = ShardedDropout(P, dim=1, rank=d.tp_rank, size=2)
    torch.manual_seed(7)
    kept = dropout(torch.ones(B, H // 2, S, S)) != 0
    both = _gather(kept, dim=1)
    assert not torch.equal(both[:, : H // 2], both[:, H // 2 :]), "the ranks drew the same masks"
    assert 0.05 < 1 - both.float().mean().item() < 0.15  # about p dropped
    torch.manual_seed(7)
    assert torch.equal(both, torch.nn.functional.dropout(torch.ones(B, H, S, S), P) != 0)

    # the kernel under TP: its heads of TP=1's SDPA with dropout, in training; the kernel in eval
    plain = SDPAKernel(P)
    kernel = TensorParallelKernel(SDPAKernel(P), d.tp_rank, 2)
    torch.manual_seed(11)
    got = _gather(kernel(q[:, mine], k[:, mine], v[:, mine], mask), dim=1)
    torch.manual_seed(11)
    assert_close(got, plain(q, k, v, mask), rtol=1e-5, atol=1e-6)
    kernel.eval()
    plain.eval()
    assert torch.equal(kernel(q[:, mine], k[:, mine], v[:, mine], mask), plain(q, k, v, mask)[:, mine])

    # hidden dropout under sequence parallelism: the ranks' tokens of TP=1's mask
    x = torch.randn(B, S, 32, generator=g)
    own = x.chunk(2, dim=1)[d.tp_rank]
    torch.manual_seed(13)
    got = _gather(ShardedDropout(P, dim=1, rank=d.tp_rank, size=2)(own), dim=1)
    torch.manual_seed(13)
    assert_close(got, torch.nn.functional.dropout(x, P), rtol=1e-6, atol=0)


def test_each_rank_keeps_its_chunk_of_the_tp1_dropout_mask():
    run_ranks(_masks_are_tp1s_chunks, 2)


def _model_with_dropout_equals_tp1(attention_type: str, sequence_parallel: bool) -> None:
    initialize(2, seed=0)
    config = tiny_config(attention_type, hidden_dropout_prob=P, attention_probs_dropout_prob=P)
    ref = reference_model(config)
    # under sequence parallelism the last layer computes every position: so does the reference,
    # whose hidden dropout then draws for the same (B, S, d) tensor
    ref.last_layer_on_labels = not sequence_parallel
    model = parallelize(copy.deepcopy(ref), 2, sequence_parallel=sequence_parallel)
    batch = mlm_batch(seed=1, vocab=config.vocab_size)
    out = {}
    for name, m in (("tp1", ref), ("tp2", model)):
        torch.manual_seed(5)  # the same default generator for both: TP=2 draws what TP=1 draws
        out[name] = m(**batch)
        out[name].loss.backward()
    assert_close(out["tp2"].loss, out["tp1"].loss)
    assert_close(out["tp2"].logits, out["tp1"].logits)
    grads = gather_tensors({n: p.grad for n, p in model.named_parameters()}, config)
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # and a different draw gives a different loss: the dropout is on
    torch.manual_seed(6)
    assert not torch.equal(model(**batch).loss, out["tp2"].loss)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("attention_type", ["shared", "standard"])
def test_tp2_with_dropout_equals_tp1(attention_type, sequence_parallel):
    """Dropout 0.1 on attention and hidden states: TP=2's loss, logits and gathered gradients are
    TP=1's under the same seed (every mask is TP=1's), with and without sequence parallelism."""
    run_ranks(_model_with_dropout_equals_tp1, 2, attention_type, sequence_parallel)
