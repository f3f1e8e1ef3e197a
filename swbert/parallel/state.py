"""Process groups: megatron-core's `parallel_state`, the sizes the trainer needs, and DeepSpeed's `mpu`.

Ranks are laid out tensor-parallel first (megatron-core's default order): with 4 processes and
TP=2, ranks {0, 1} and {2, 3} each hold one copy of the model split in two, and ranks {0, 2} and
{1, 3} are the data-parallel groups that all-reduce (or ZeRO-partition) gradients.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

from swbert.parallel import cpu_compat
from swbert.runtime.ranks import ParallelDims

logger = logging.getLogger(__name__)

# megatron-core's offset between the data-parallel seed and the tensor-parallel ("model-parallel-rng")
# seeds; any positive value works, this one keeps seeds comparable with Megatron-LM runs.
_TP_SEED_OFFSET = 2718


def log_rank0(msg: str, *args: object) -> None:
    """Log on global rank 0 only (every rank does the same steps; one copy is enough)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(msg, *args)


def initialize(tp_size: int, seed: int = 1234) -> ParallelDims:
    """Create the tensor- and data-parallel groups; data-parallel size = world size / `tp_size`.

    Call after `deepspeed.init_distributed` (or `torch.distributed.init_process_group`) and, on
    GPU, after `torch.cuda.set_device(local_rank)`. Without CUDA it first applies
    `swbert.parallel.cpu_compat`. Calling it again with the same `tp_size` returns the same dims.
    `seed` seeds the RNGs as `manual_seed` describes.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call deepspeed.init_distributed() (gloo on CPU, "
            "nccl on GPU) before swbert.parallel.initialize()"
        )
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size != 0:
        raise ValueError(
            f"--tensor-parallel {tp_size} does not divide the number of processes ({world}); launch a "
            f"multiple of {tp_size} processes (e.g. torchrun --nproc_per_node {max(tp_size, 1)}) or pick a "
            f"tensor-parallel size that divides {world}"
        )
    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tp_size:
            raise RuntimeError(
                f"model-parallel groups already exist with tensor-parallel size {current}; "
                f"call swbert.parallel.destroy() before initializing with {tp_size}"
            )
    else:
        # megatron's extra gloo groups serve its own distributed optimizer, which DeepSpeed replaces.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size, create_gloo_process_groups=False
        )
        log_rank0("tensor parallel %d x data parallel %d over %d processes", tp_size, world // tp_size, world)
    manual_seed(seed)
    return dims()


def dims() -> ParallelDims:
    """The `ParallelDims` of this process (after `initialize`)."""
    _require_initialized()
    d = ParallelDims(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),  # the ranks follow (TP first)
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )
    if (d.tp_rank, d.dp_rank) != (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    ):
        raise RuntimeError("megatron-core laid out its ranks otherwise than tensor-parallel first")
    return d


def is_initialized() -> bool:
    return parallel_state.model_parallel_is_initialized()


def destroy() -> None:
    """Drop the groups (e.g. between tests, or before re-initializing with another size)."""
    parallel_state.destroy_model_parallel()


def manual_seed(seed: int) -> None:
    """Seed the default generators with `seed + dp_rank` and megatron's tracker per TP rank.

    Within a tensor-parallel group every rank must draw the same dropout masks on the replicated
    activations (embeddings, residual branches), or the copies of the residual stream drift apart;
    the default generator is therefore seeded by data-parallel rank only. Dropout on what a rank
    holds alone (its heads' attention probabilities; its tokens under sequence parallelism) draws
    from that generator too, keeping its chunk of the whole tensor's mask
    (`swbert.parallel.layers.ShardedDropout`): no generator state is swapped, which torch.compile
    could not trace. megatron's "model-parallel-rng" tracker, which differs on every rank, is
    still seeded (and checkpointed) for megatron-core code that forks it; swbert's layers do not.
    """
    d = dims()
    torch.manual_seed(seed + d.dp_rank)  # also seeds CUDA when present
    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + dist.get_rank())


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """megatron's tracker states, to save with a checkpoint for an exact resume."""
    return dict(mcore_random.get_cuda_rng_tracker().get_states())


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_tracker_states` returned (same rank, same tensor-parallel size)."""
    mcore_random.get_cuda_rng_tracker().set_states(dict(states))


def _require_initialized() -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call swbert.parallel.initialize(tp_size) first")


class DeepSpeedMPU:
    """The groups in the interface DeepSpeed expects of `deepspeed.initialize(..., mpu=...)`.

    megatron-core's `parallel_state` dropped `get_model_parallel_*`, which DeepSpeed calls (with
    pipeline size 1, "model parallel" is tensor parallel). Without an `mpu`, DeepSpeed takes every
    process for a data-parallel replica: it broadcasts TP rank 0's shards over the others at
    start-up and averages gradients of different shards, and the run finishes with a wrong model.

    It deliberately has no `get_sequence_parallel_*` methods: DeepSpeed reads those as its own
    (Ulysses) sequence parallelism, which is unrelated to megatron's.
    """

    def __getattr__(self, name: str) -> Callable[[], Any]:
        # DeepSpeed's name -> megatron-core's function of that name (model parallel: tensor parallel)
        target = _MPU_RENAMED.get(name, name if name in _MPU_SAME else None)
        if target is None:
            raise AttributeError(f"{type(self).__name__} has no {name!r}")
        return getattr(parallel_state, target)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


_GETTERS = ("group", "rank", "world_size")
_MPU_RENAMED = {f"get_model_parallel_{g}": f"get_tensor_model_parallel_{g}" for g in _GETTERS}
_MPU_SAME = {
    f"get_{kind}_parallel_{g}" for kind in ("tensor_model", "data", "pipeline_model") for g in _GETTERS
} | {"get_tensor_model_parallel_src_rank"}


def mpu() -> DeepSpeedMPU:
    """The object to pass as `deepspeed.initialize(..., mpu=swbert.parallel.mpu())`."""
    _require_initialized()
    return DeepSpeedMPU()
