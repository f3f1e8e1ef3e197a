"""Unit tests of the parallel grid (swbert.runtime.ranks.ParallelDims): megatron-core's
tensor-parallel-first layout, and the launcher's environment read without a process group."""

from __future__ import annotations

import pytest

from swbert.runtime.ranks import ParallelDims


def test_tensor_parallel_ranks_are_neighbours_and_data_parallel_ranks_stride():
    grid = [ParallelDims.plan(world=8, tp_size=2, rank=r) for r in range(8)]
    assert [(d.tp_rank, d.dp_rank) for d in grid] == [(r % 2, r // 2) for r in range(8)]
    assert {d.dp_size for d in grid} == {4} and all(d.is_tp_enabled for d in grid)
    tp_groups = {d.dp_rank: [e.rank for e in grid if e.dp_rank == d.dp_rank] for d in grid}
    assert tp_groups[0] == [0, 1] and tp_groups[3] == [6, 7]
    assert [d.rank for d in grid if d.tp_rank == 1] == [1, 3, 5, 7]  # one data-parallel group


def test_without_tensor_parallelism_every_rank_is_data_parallel():
    d = ParallelDims.plan(world=4, rank=3, local_rank=1)
    assert (d.tp_size, d.tp_rank, d.dp_size, d.dp_rank, d.local_rank) == (1, 0, 4, 3, 1)
    assert not d.is_tp_enabled and not d.is_main
    assert ParallelDims.plan(world=4).is_main


@pytest.mark.parametrize("world, tp", [(6, 4), (4, 0), (2, 3)])
def test_a_tp_size_that_does_not_divide_the_world_says_what_to_launch(world, tp):
    with pytest.raises(ValueError, match=f"world size {world} is not divisible by --tensor-parallel {tp}"):
        ParallelDims.plan(world, tp)


def test_from_env_reads_the_launcher_variables(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert ParallelDims.from_env() == ParallelDims()  # one process
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    d = ParallelDims.from_env(tp_size=2)
    assert (d.rank, d.world, d.local_rank, d.tp_rank, d.dp_rank, d.dp_size) == (3, 4, 1, 1, 1, 2)


def test_the_grid_is_frozen():
    with pytest.raises(AttributeError):
        ParallelDims().rank = 1  # type: ignore[misc]
