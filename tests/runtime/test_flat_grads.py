"""ZeRO-2 with flat gradients (`swbert.runtime.flat_grads`) against DeepSpeed's own per-tensor path,
on real engines, 2 ranks on gloo, bf16 with fp32 accumulation: the same updates, the same gradient
norm, fp32 accumulation kept, a non-finite step skipped, and bf16 reduction (ours: one reduce-scatter
per step after fp32 accumulation) within a bound of fp32 reduction."""

from __future__ import annotations

import pytest
import torch

from swbert.runtime.ds_config import BatchShape, build_ds_config, load_ds_config
from tests.parallel.test_parallel_harness import mlm_batch, reference_model, run_ranks, tiny_config

ACCUM = 2


def _engine(flat: bool, comm: str = "bf16", lr: float = 1e-3):
    import deepspeed

    from swbert.runtime.flat_grads import FlatGradZeroOptimizer, flatten_gradients

    ds = build_ds_config("ds_configs/zero2.json", BatchShape(16, 4, ACCUM), 1.0, "bf16")
    ds["communication_data_type"] = comm
    model = reference_model(tiny_config("shared"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    if flat:
        assert flatten_gradients(engine)
    assert isinstance(engine.optimizer, FlatGradZeroOptimizer) is flat
    return engine


def _steps(
    engine, scales: list[tuple[float, float]], agree: bool = False, same: bool = False
) -> list[torch.Tensor]:
    """One optimizer step per pair of micro-batch loss scales; the fp32 gradient norm of each step.
    `same`: every micro-batch of every step is this rank's one batch."""
    rank = torch.distributed.get_rank()
    norms = []
    for step, pair in enumerate(scales):
        for micro, scale in enumerate(pair):
            engine.set_gradient_accumulation_boundary(micro == ACCUM - 1)
            seed = 2 * rank if same else 10 * step + 2 * rank + micro
            loss = engine(**mlm_batch(seed)).loss * scale
            engine.backward(loss)
            if agree and micro == ACCUM - 1:
                bad = engine.optimizer.local_nonfinite().float()
                torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
                engine.optimizer.agree_overflow(bool(bad.item()))
            engine.step()
        norms.append(torch.as_tensor(engine.get_global_grad_norm(), dtype=torch.float32).clone())
    return norms


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _flat_equals_deepspeed() -> None:
    scales = [(1.0, 1.0), (1.0, 0.5), (1.0, 1.0)]
    ours, theirs = _engine(True), _engine(False)
    ours_norms, theirs_norms = _steps(ours, scales, agree=True), _steps(theirs, scales)
    # the same bf16 reduction and fp32 sums, in another order: within a few bf16 roundings
    torch.testing.assert_close(torch.stack(ours_norms), torch.stack(theirs_norms), rtol=2e-2, atol=0)
    for a, b in zip(_params(ours), _params(theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)  # bf16 weights, lr 1e-3, 3 steps
    assert all(p.grad is not None for p in ours.module.parameters())  # the flat views stay

    # fp32 accumulation kept: g + g * 2**-10 is g in bf16; lr 0 keeps the weights for the second step.
    # Reduced in fp32 here: a bf16 reduction rounds the step's sum once (the bound below)
    engine = _engine(True, comm="fp32", lr=0.0)
    norms = _steps(engine, [(1.0, 2.0**-10), (1.0, 0.0)], same=True)
    ratio = float(norms[0] / norms[1])
    assert abs(ratio - (1 + 2**-10)) < 2**-14, ratio

    # a non-finite gradient on one rank: agreed, the step skipped on both, the weights kept
    before = _params(engine)
    poison = float("nan") if torch.distributed.get_rank() == 1 else 1.0
    _steps(engine, [(1.0, poison)], agree=True)
    assert not engine.was_step_applied()
    for a, b in zip(_params(engine), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _steps(engine, [(1.0, 1.0)], agree=True)  # and the next step applies
    assert engine.was_step_applied()


def _bf16_reduction_is_close_to_fp32() -> None:
    """The same gradients reduced in bf16 and in fp32 (after fp32 accumulation): each rank's reduced
    partition within 2**-7 relative (a bf16 rounding of each rank's sum and of the result), measured
    as the norm of the difference over the norm of the fp32 result."""
    partitions = {}
    for comm in ("fp32", "bf16"):
        engine = _engine(True, comm=comm, lr=0.0)
        for micro in range(ACCUM):
            engine.set_gradient_accumulation_boundary(micro == ACCUM - 1)
            engine.backward(engine(**mlm_batch(2 * torch.distributed.get_rank() + micro)).loss)
        partitions[comm] = torch.cat([p.flat_partition.clone() for p in engine.optimizer.partitions])
    fp32, bf16 = partitions["fp32"], partitions["bf16"]
    assert bf16.abs().sum() > 0 and not torch.equal(fp32, bf16)  # both reduced, and they differ
    relative = (bf16 - fp32).norm() / fp32.norm()
    assert relative < 2**-7, float(relative)


def _resume_is_exact(folder: str) -> None:
    """A flat engine's checkpoint, loaded into a new flat engine, continues exactly as the saver."""
    saver = _engine(True)
    _steps(saver, [(1.0, 1.0)], agree=True)
    saver.save_checkpoint(folder, tag="one")
    _steps(saver, [(1.0, 0.5)], agree=True)
    loader = _engine(True)
    loader.load_checkpoint(folder, tag="one")
    _steps(loader, [(1.0, 0.5)], agree=True)
    for a, b in zip(_params(loader), _params(saver)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_a_flat_checkpoint_resumes_exactly(tmp_path):
    run_ranks(_resume_is_exact, 2, str(tmp_path / "ckpt"), deepspeed=True)


@pytest.mark.slow
def test_flat_zero2_gradients_equal_deepspeeds_and_skip_nonfinite_steps():
    run_ranks(_flat_equals_deepspeed, 2, deepspeed=True)


@pytest.mark.slow
def test_bf16_gradient_reduction_is_within_a_bound_of_fp32():
    run_ranks(_bf16_reduction_is_close_to_fp32, 2, deepspeed=True)


def _warnings(tmp_path, caplog, precision: str = "bf16", top: dict | None = None, **zero: object) -> str:
    """The warnings of zero2.json with `zero` in its zero_optimization and `top` at its top level."""
    import json

    ds = {**load_ds_config("ds_configs/zero2.json"), **(top or {})}
    ds["zero_optimization"].update(zero)
    path = tmp_path / "user.json"
    path.write_text(json.dumps(ds))
    caplog.clear()
    with caplog.at_level("WARNING", logger="swbert.runtime.ds_config"):
        build_ds_config(path, BatchShape(16, 4, 4), 1.0, precision)
    return "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_a_config_that_brings_back_host_work_is_one_warning_per_key(tmp_path, caplog):
    """A user's JSON that brings back per-tensor loops or per-micro-batch syncs: one warning each,
    naming the key and its cost; the shipped zero2.json in bf16 gets none."""
    assert _warnings(tmp_path, caplog) == ""
    comm = _warnings(tmp_path, caplog, top={"communication_data_type": "fp32"})
    assert comm.count("\n") == 0 and "communication_data_type=fp32" in comm and "twice the bytes" in comm
    robin = _warnings(tmp_path, caplog, round_robin_gradients=True)  # no flat gradients: each cost
    assert "round_robin_gradients=true" in robin and "six host syncs" in robin
    stage3 = _warnings(tmp_path, caplog, stage=3, contiguous_gradients=False)
    assert "overlap_comm=true with 4 micro-batches" in stage3 and "(4 host syncs a step)" in stage3
    assert "contiguous_gradients=false" in stage3 and stage3.count("\n") == 1  # two keys, two lines
    assert _warnings(tmp_path, caplog, "fp32") == ""  # fp32 (a CPU run): nothing to sync on
