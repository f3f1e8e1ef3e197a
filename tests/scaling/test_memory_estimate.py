"""The activation estimate (swbert.scaling.activations) against the bytes the real model keeps.

A forward of SWBertForMaskedLM, wrapped as the trainer wraps it (`wrap_model`), runs under a
dispatch mode that notes the storage of every tensor an op makes; the storages still alive when
the forward has returned are what the backward will read: autograd's saved tensors, the inputs
activation checkpointing keeps, the outputs selective checkpointing caches, and the logits the
model returns. Parameters and the batch existed before and are not counted, nor are the
generator states the tensor-parallel checkpoint replay clones (5 KB a block on a CPU, 16 bytes on
a GPU: not activations).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.attention import attention_class
from swbert.scaling.activations import activation_memory, attention_trace
from swbert.training.wrappers import wrap_model
from tests.model_helpers import PAPER_VARIANTS
from tests.parallel.test_parallel_harness import run_ranks

B, S, P = 4, 64, 10  # sequences, tokens per sequence, predicted positions per sequence
assert P == round(0.15 * S)  # the 15% the estimate predicts
VOCAB = 100
# The estimate leaves out the loss's scalars (the count of labelled rows, the sums, the check of its
# targets): 52 bytes, at any tensor-parallel size.
SCALARS = 64
TP_LOSS_BOOKKEEPING = SCALARS


class Births(TorchDispatchMode):
    """Storages made by ops while active, with their size; `alive()` sums those still alive.

    `recompute`: from now on, count the storages made with grad mode on (the checkpoint's recompute
    in the backward) apart from those of the backward itself, and keep the peak of the former.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.in_recompute = False
        self.recompute_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        recomputed = self.in_recompute and torch.is_grad_enabled()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype != torch.uint8:  # uint8: generator states
                storage = t.untyped_storage()
                known = self.storages.get(storage._cdata)
                if known is None or known[0].expired():  # a freed storage's address may be reused
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes(), recomputed)
        if self.in_recompute:
            self.recompute_peak = max(self.recompute_peak, self.alive(recomputed=True))
        return out

    def alive(self, exclude: set[int] = frozenset(), recomputed: bool = False) -> int:
        return sum(
            n
            for key, (ref, n, again) in self.storages.items()
            if again == recomputed and key not in exclude and not ref.expired()
        )


def tiny(attention_type: str, **overrides: object) -> SWBertConfig:
    fields = dict(
        vocab_size=VOCAB,
        pad_vocab_multiple=64,  # a padded decoder, as the trainer builds it
        max_position_embeddings=S,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
        attention_type=attention_type,
    )
    return SWBertConfig.from_size("tiny", **{**fields, **overrides})


def static_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's static-shape batch: P predicted positions per sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (B, S), generator=g)
    positions = torch.stack([torch.randperm(S - 2, generator=g)[:P] + 1 for _ in range(B)])
    targets = torch.randint(5, VOCAB, positions.shape, generator=g)
    return {"input_ids": ids, "mlm_positions": positions, "mlm_targets": targets}


def measure(model: SWBertForMaskedLM, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(bytes kept from the end of the forward into the backward, peak of the recomputed bytes)."""
    before = {t.untyped_storage()._cdata for t in [*model.parameters(), *batch.values()]}
    births = Births()
    with births:
        out = model(**batch, return_logits=False)  # the trainer's path: the chunked loss, no logits
        # what only a reference cycle holds is garbage the backward will not read; when the cyclic
        # collector last ran is chance, so collect it before counting
        gc.collect()
        kept = births.alive(before)
        births.in_recompute = True
        out.loss.backward()
    return kept, births.recompute_peak


CASES = [(a, "fp32", 0.0) for a in PAPER_VARIANTS] + [(a, "bf16", 0.1) for a in ("standard", "shared")]


@pytest.mark.parametrize(("attention_type", "precision", "attention_dropout"), CASES)
def test_estimate_is_the_bytes_the_model_keeps(attention_type, precision, attention_dropout):
    """Every checkpointing mode, to the byte but for the loss's scalars, and the recompute's peak.
    bf16 with attention dropout runs the CPU's math attention (S x S scores, probabilities and
    dropout noise kept); without, the fused kernel a GPU runs."""
    config = tiny(attention_type, attention_probs_dropout_prob=attention_dropout)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    plain = SWBertForMaskedLM(config).to(dtype).train()
    batch = static_batch()
    measured, estimated = {}, {}
    for mode in ("none", "full", "selective"):
        model = wrap_model(copy.deepcopy(plain), activation_checkpointing=mode, log_steps=False)
        measured[mode], recompute_peak = measure(model, batch)
        estimate = activation_memory(config, S, B, precision, checkpointing=mode, device="cpu")
        estimated[mode] = estimate.kept
        assert 0 <= measured[mode] - estimate.kept <= SCALARS, (mode, measured[mode], estimate)
        if mode != "none" and attention_dropout == 0:
            # the recompute also has an op's output in flight before the next op frees its input:
            # at most two (B, S, d) tensors above what the recomputed block keeps for its backward
            # (the CPU's math attention has S x S temporaries in flight too: not checked there)
            in_flight = 2 * dtype.itemsize * B * S * config.hidden_size
            assert estimate.recompute <= recompute_peak <= estimate.recompute + in_flight + SCALARS, (
                mode, recompute_peak, estimate,
            )  # fmt: skip
    # the ratios that follow: full and selective against none, as measured and as estimated
    for mode in ("full", "selective"):
        assert estimated[mode] / estimated["none"] == pytest.approx(
            measured[mode] / measured["none"],
            rel=5e-4,  # the loss's scalars, left out, weigh most in full
        )
    assert measured["full"] < measured["selective"] < measured["none"]


def test_traced_attention_agrees_with_the_declared_activation_units():
    """`SelfAttention.activation_units` (Korthikanti's units at 16 bits, 34 for BERT's Q, K, V) is what
    the module keeps: per token, (units - 26) d bytes for Q/K/V-side tensors and the kernel output,
    plus the fp32 log-sum-exp of each head."""
    for attention_type in PAPER_VARIANTS:
        config = SWBertConfig.from_size("base", attention_type=attention_type)
        d, h = config.hidden_size, config.num_attention_heads
        # two token counts: the difference leaves out what a layer keeps once (shared's scaled weight)
        per_token = (attention_trace(config, 1, 16).saved - attention_trace(config, 1, 8).saved) / 8
        units = attention_class(attention_type).activation_units
        assert per_token == (units - 26) * d + 4 * h, attention_type


@pytest.mark.parametrize(
    ("tp", "sequence_parallel", "mode", "units"),
    [
        (1, False, "none", 34),  # Korthikanti et al. (2022), Table 2: 34 s b h
        (2, False, "none", 10 + 24 / 2),  # tensor parallelism: 10 + 24/t
        (2, True, "none", 4 + 30 / 2),  # theirs 34/t; here the gathered region inputs stay whole
        (1, False, "full", 2),  # the block's input
        (2, True, "full", 2 / 2),  # its S/t chunk
        (1, False, "selective", 2 + 6 + 2 + 2 + 8 + 2),  # input, QKV, kernel out, out-proj, fc1, fc2
    ],
)
def test_one_block_in_the_papers_units(tp, sequence_parallel, mode, units):
    """BERT-base, standard attention, bf16 on a GPU: one block's bytes per token in units of d, plus
    the LayerNorm stats (2 x 8 bytes, split by sequence parallelism) and the kernel's log-sum-exp
    (4 bytes a head, split by tensor parallelism) where the mode keeps them."""
    config = SWBertConfig.from_size("base", attention_type="standard")
    deeper = SWBertConfig.from_size("base", attention_type="standard", num_hidden_layers=13)
    tokens = 8 * 128

    def blocks(c: SWBertConfig) -> float:
        return activation_memory(c, 128, 8, "bf16", tp, sequence_parallel, mode).blocks

    d, h = config.hidden_size, config.num_attention_heads
    extra = {"none": 16 / (tp if sequence_parallel else 1) + 4 * h / tp, "full": 0, "selective": 4 * h}[mode]
    assert (blocks(deeper) - blocks(config)) / tokens == units * d + extra


def _tensor_parallel_rank() -> None:
    from swbert import parallel

    parallel.initialize(2, seed=0)
    batch = static_batch()
    for attention_type in ("standard", "shared"):
        config = tiny(attention_type)
        rows = []
        for sequence_parallel in (False, True):
            for mode in ("none", "full"):
                torch.manual_seed(0)
                model = wrap_model(
                    SWBertForMaskedLM(config).train(),
                    tp_size=2,
                    sequence_parallel=sequence_parallel,
                    activation_checkpointing=mode,
                    log_steps=False,
                )
                measured, _ = measure(model, batch)
                estimate = activation_memory(config, S, B, "fp32", 2, sequence_parallel, mode, device="cpu")
                rows.append((sequence_parallel, mode, measured, estimate.kept))
                assert 0 <= measured - estimate.kept <= TP_LOSS_BOOKKEEPING, (
                    attention_type, sequence_parallel, mode, measured, estimate,
                )  # fmt: skip
        if dist.get_rank() == 0:
            kept = {(sp, mode): measured for sp, mode, measured, _ in rows}
            # full checkpointing with sequence parallelism keeps each block's S/2 chunk only
            assert kept[(True, "full")] < kept[(False, "full")], rows


@pytest.mark.slow
def test_estimate_per_rank_with_and_without_sequence_parallelism():
    """Two ranks on gloo, TP=2: the bytes each rank keeps, with and without sequence parallelism,
    with and without full checkpointing, against the estimate for that rank."""
    run_ranks(_tensor_parallel_rank, 2)


def test_the_attention_trace_counts_every_storage_however_addresses_are_reused():
    """The trace keys storages by address; a storage freed mid-forward may hand its address to the
    next one. Traced again and again between allocations that shift the addresses, the count is one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from swbert.scaling.activations import _trace_once

    config = tiny("shared", attention_probs_dropout_prob=0.1)
    counts, junk = set(), []
    for i in range(60):
        with FakeTensorMode():
            junk.append([torch.empty(3) for _ in range(i % 5)])
        counts.add(_trace_once(config, torch.bfloat16, B, S, None))
        if i % 3 == 0:
            junk.pop(0)
    assert len(counts) == 1, counts
