"""The vocab-parallel chunked masked-LM loss (ours) and its predictions at TP=2 equal TP=1's plain
cross entropy on full logits and their argmax: loss, gradients and accuracy, in real 2-rank gloo
processes, eager and compiled (aot_eager, fullgraph: its collectives inside the head's graph), with
the vocabulary padding in rank 1's shard or making up all of it, and on exact ties across ranks."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertForMaskedLM
from swbert.models.modeling import IGNORE_INDEX
from swbert.parallel import destroy, gather_tensors, initialize, parallelize
from tests.parallel.test_parallel_harness import reference_model, run_ranks, tiny_config

B, S, P = 4, 16, 5


def _batch(vocab: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """The trainer's static shapes: P predicted positions a sequence, some of them padding."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(5, vocab, (B, P), generator=g)
    targets[1, 3:] = IGNORE_INDEX
    return {
        "input_ids": torch.randint(5, vocab, (B, S), generator=g),
        "mlm_positions": torch.randint(0, S, (B, P), generator=g),
        "mlm_targets": targets,
    }


def _check(
    attention_type: str, sequence_parallel: bool, compiled: bool, tie: bool = False, **overrides
) -> None:
    config = tiny_config(attention_type, **overrides)
    ref = reference_model(config).train()
    if tie:  # ids 3 (rank 0's shard) and 100 (rank 1's) score exactly 50 on every row: argmax says 3
        with torch.no_grad():
            ref.mlm_head.decoder.weight[[3, 100]] = 0.0
            ref.mlm_head.decoder.bias[[3, 100]] = 50.0
    model = SWBertForMaskedLM(config)
    model.load_state_dict(ref.state_dict())
    initialize(2)
    parallelize(model, 2, sequence_parallel=sequence_parallel)
    model.train()
    model.mlm_head.chunk_bytes = 4 * B * P * 7  # 7-column chunks: several per rank's shard
    if compiled:
        model.mlm_head.forward = torch.compile(model.mlm_head.forward, backend="aot_eager", fullgraph=True)
    batch = _batch(config.vocab_size)
    expected = ref(**batch)  # the plain formula: F.cross_entropy on the (N, vocab) logits
    got = model(**batch, return_logits=False)
    assert got.logits is None
    expected.loss.backward()
    got.loss.backward()
    assert_close(got.loss, expected.loss)
    predicted = expected.logits.argmax(-1)
    assert torch.equal(got.predictions, predicted)
    if tie:
        assert (predicted == 3).all()
    target = batch["mlm_targets"].reshape(-1)
    correct = ((got.predictions == target) & (target != IGNORE_INDEX)).sum()
    assert correct == ((predicted == target) & (target != IGNORE_INDEX)).sum()
    grads = gather_tensors({n: p.grad for n, p in model.named_parameters()}, config)
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    destroy()


def _all_cases() -> None:
    _check("shared", False, compiled=False)
    _check("shared", False, compiled=True)
    _check("standard", True, compiled=True)  # sequence parallelism: the head after the gather
    # a padded vocabulary: 100 ids in 128 rows, the padding in rank 1's shard; then 60 ids, rank 1's
    # shard all padding (no logit there at all)
    _check("standard", False, compiled=False, vocab_size=100, pad_vocab_multiple=128)
    _check("shared", False, compiled=True, vocab_size=60, pad_vocab_multiple=128)
    _check("shared", False, compiled=False, tie=True)


@pytest.mark.slow
def test_tp2_chunked_loss_and_accuracy_equal_tp1():
    run_ranks(_all_cases, 2)
