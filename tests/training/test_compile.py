"""The GPU's engine defaults on CPU: compile per unit, activation checkpointing, tensor parallelism
under compile, and ZeRO's gradient reduce overlapping the backward.

Compiled and eager runs agree to float32 rounding (inductor fuses and reorders reductions): losses
and gradients within rtol 1e-4 / atol 1e-5 here, and within 1e-3 relative over a whole training
run in tests/e2e/test_pretrain_compiled.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from swbert.models import SWBertForMaskedLM
from swbert.training.wrappers import wrap_model
from tests.parallel.test_parallel_harness import reference_model, run_ranks, tiny_config

TOL = {"rtol": 1e-4, "atol": 1e-5}


def static_batch(seed: int, batch: int = 4, seq: int = 32, predictions: int = 5, vocab: int = 128) -> dict:
    """The trainer's static-shape batch: a fixed number of predicted positions per sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    positions = torch.stack([torch.randperm(seq - 2, generator=g)[:predictions] + 1 for _ in range(batch)])
    targets = torch.randint(5, vocab, positions.shape, generator=g)
    targets[-1, -1] = -100  # a padded prediction, as the loader writes them
    return {"input_ids": ids, "mlm_positions": positions, "mlm_targets": targets}


def loss_and_grads(model: SWBertForMaskedLM, batch: dict, seed: int = 0) -> tuple[torch.Tensor, dict]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout draws for every model compared
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_tensor_count(model: SWBertForMaskedLM, batch: dict) -> int:
    """Tensors the autograd graph of one forward keeps for the backward."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    return count


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("attention_type", ["shared", "standard"])
def test_activation_checkpointing_equals_the_plain_model_with_dropout(mode, attention_type):
    """Dropout on, so a recompute that drew other masks would give other gradients."""
    config = tiny_config(attention_type, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    plain = reference_model(config)
    wrapped = wrap_model(copy.deepcopy(plain), activation_checkpointing=mode, log_steps=False)
    batch = static_batch(0)
    loss, grads = loss_and_grads(plain, batch)
    loss_ac, grads_ac = loss_and_grads(wrapped, batch)
    assert_close(loss_ac, loss, rtol=0, atol=0)
    assert grads_ac.keys() == grads.keys()
    for name in grads:
        assert_close(
            grads_ac[name], grads[name], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )
    # it recomputes: the saved activations are fewer (a checkpointed forward saves its inputs only)
    saved = {label: saved_tensor_count(model, batch) for label, model in (("plain", plain), ("ac", wrapped))}
    assert saved["ac"] < saved["plain"], saved


def compiled_equals_eager(compiled: SWBertForMaskedLM, eager: SWBertForMaskedLM) -> dict:
    """Two steps' losses and gradients of `compiled` equal `eager`'s within TOL; returns the graph
    breaks dynamo counted meanwhile."""
    torch._dynamo.utils.counters.clear()
    for seed in range(2):
        batch = static_batch(seed)
        loss, grads = loss_and_grads(eager, batch)
        loss_c, grads_c = loss_and_grads(compiled, batch)
        assert_close(loss_c, loss, **TOL)
        for name in grads:
            assert_close(grads_c[name], grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.slow
# selective checkpointing (not the default) compiled: make test-long
@pytest.mark.parametrize("mode", ["none", pytest.param("selective", marks=pytest.mark.long)])
def test_compiled_per_block_equals_eager(mode):
    config = tiny_config("shared")
    eager = reference_model(config)
    compiled = wrap_model(copy.deepcopy(eager), compile=True, activation_checkpointing=mode, log_steps=False)
    # the names, the state dict and the blocks are the eager model's: checkpoints do not change
    assert list(compiled.state_dict()) == list(eager.state_dict())
    breaks = compiled_equals_eager(compiled, eager)
    assert not breaks, breaks


def _tp_compiled_rank(sequence_parallel: bool) -> None:
    from swbert import parallel

    parallel.initialize(2, seed=0)
    config = tiny_config("shared")
    eager = wrap_model(
        reference_model(config), tp_size=2, sequence_parallel=sequence_parallel, log_steps=False
    )
    compiled = wrap_model(
        reference_model(config), tp_size=2, sequence_parallel=sequence_parallel, compile=True, log_steps=False
    )
    breaks = compiled_equals_eager(compiled, eager)
    assert not breaks, f"graph breaks under tensor parallelism: {breaks}"


# long: CI holds the same through the compiled TP+SP launcher test (TORCH_LOGS=graph_breaks). Both cases
# failed once, in a loaded clean-clone run before run_ranks retried a taken port and waited on
# HANG_S; not reproduced since: alone, nor with a cold inductor cache beside two busy processes.
@pytest.mark.long
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_compiles_without_a_graph_break(sequence_parallel):
    """The TP group is passed explicitly to every megatron region: no graph break, and compiled
    equals eager (dropout 0 here: with dropout, see the next test)."""
    run_ranks(_tp_compiled_rank, 2, sequence_parallel)


def _tp_compiled_dropout_rank(sequence_parallel: bool) -> None:
    from swbert import parallel

    parallel.initialize(2, seed=0)
    config = tiny_config("shared", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = wrap_model(
        reference_model(config),
        tp_size=2,
        sequence_parallel=sequence_parallel,
        compile=True,
        compile_backend="aot_eager",  # dynamo's graphs and AOTAutograd's split, without C++ kernels
        log_steps=False,
    )
    torch._dynamo.utils.counters.clear()
    for seed in range(2):
        loss, grads = loss_and_grads(model, static_batch(seed), seed=seed)
        assert loss.isfinite() and grads
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, f"graph breaks under tensor parallelism with dropout: {breaks}"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_with_dropout_compiles_without_a_graph_break(sequence_parallel):
    """At the recipes' dropout (0.1) the per-rank draws (attention dropout on each rank's heads,
    hidden dropout on each rank's tokens under sequence parallelism) swap no generator state:
    each block compiles whole."""
    run_ranks(_tp_compiled_dropout_rank, 2, sequence_parallel)


def _tp_checkpointed_rank(mode: str) -> None:
    from swbert import parallel

    parallel.initialize(2, seed=0)
    config = tiny_config("shared", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    plain = wrap_model(reference_model(config), tp_size=2, log_steps=False)
    checkpointed = wrap_model(
        reference_model(config), tp_size=2, activation_checkpointing=mode, log_steps=False
    )
    batch = static_batch(0)
    loss, grads = loss_and_grads(plain, batch)  # the same default generator seed for both
    loss_ac, grads_ac = loss_and_grads(checkpointed, batch)
    assert_close(loss_ac, loss, rtol=0, atol=0)
    for name in grads:
        assert_close(
            grads_ac[name], grads[name], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow  # two ranks
def test_activation_checkpointing_under_tensor_parallelism_redraws_the_same_dropout():
    """Attention dropout under TP keeps this rank's heads of a draw from the default generator,
    which the recompute restores: the same masks, the same gradients.
    (Selective checkpointing is refused under TP: see test_config_refuses_what_cannot_work.)"""
    run_ranks(_tp_checkpointed_rank, 2, "full")


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["--sequence-parallel", "true"], "sequence_parallel"),
        (["--tensor-parallel", "2", "--activation-checkpointing", "selective"], "activation_checkpointing"),
        (["--activation-checkpointing", "some"], "activation_checkpointing"),
    ],
)
def test_config_refuses_what_cannot_work(overrides, key):
    from swbert.training.config import build_config

    with pytest.raises(ValueError, match=key):
        build_config("tiny_cpu", overrides)


def test_a_missing_compile_backend_is_named_before_anything_starts():
    from swbert.training.build import check_compiler

    with pytest.raises(ValueError, match="compile_backend='no_such_backend'"):
        check_compiler(torch.device("cpu"), "no_such_backend")


@pytest.mark.slow
def test_the_first_gradient_reduce_starts_early_in_the_backward():
    """Compiled per block, ZeRO-2's first gradient reduce fires while most of the backward is still
    to run (block i's reduce overlaps the backward of the blocks before it): measured about 0.08
    of it. Compiled as one graph it fires after 80%+ of it with inductor, after about half of it
    with aot_eager (benchmarks/compile_overlap.py measures all three modes).

    The backend is aot_eager: the same graphs as inductor's, one per unit with its backward split
    off by AOTAutograd, so each unit's gradients are ready when inductor's would be; without the
    C++ kernels (a minute of compiling on CPU), whose results test_compiled_per_block_equals_eager
    checks."""
    from benchmarks import compile_overlap

    result = compile_overlap.measure(
        "per_block", layers=3, hidden=128, seq=64, batch=4, reps=2, backend="aot_eager"
    )
    assert result["first_reduce_fraction"] < 0.5, result
