"""Tensor parallelism (megatron-core) applied to swbert models from outside, and its DeepSpeed wiring.

Order of calls in a trainer::

    deepspeed.init_distributed(dist_backend="gloo" or "nccl")
    dims = swbert.parallel.initialize(tp_size, seed)          # groups; dp_size = world / tp_size
    model = swbert.parallel.parallelize(SWBertForMaskedLM(config), tp_size)  # sequence_parallel=...
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=swbert.parallel.mpu())
    loss = engine(**batch).loss                               # vocab-parallel under TP

See docs/parallelism.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it, imported on first use (PEP 562): `swbert.parallel
# .plan`, which the scaling study's memory estimates use, then costs no megatron-core import.
_EXPORTS = {
    "gather_state_dict": "checkpoint",
    "gather_tensors": "checkpoint",
    "merge_state_dicts": "checkpoint",
    "shard_state_dict": "checkpoint",
    "universal_checkpoint_info": "checkpoint",
    "parallelize": "parallelize",
    "check_divisible": "plan",
    "partition_dim": "plan",
    **dict.fromkeys(
        ["DeepSpeedMPU", "ParallelDims", "destroy", "dims", "initialize", "is_initialized", "manual_seed",
         "mpu", "rng_tracker_states", "set_rng_tracker_states"],
        "state",
    ),
}  # fmt: skip

if TYPE_CHECKING:
    from swbert.parallel.checkpoint import (
        gather_state_dict,
        gather_tensors,
        merge_state_dicts,
        shard_state_dict,
        universal_checkpoint_info,
    )
    from swbert.parallel.parallelize import parallelize
    from swbert.parallel.plan import check_divisible, partition_dim
    from swbert.parallel.state import (
        DeepSpeedMPU,
        ParallelDims,
        destroy,
        dims,
        initialize,
        is_initialized,
        manual_seed,
        mpu,
        rng_tracker_states,
        set_rng_tracker_states,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "DeepSpeedMPU",
    "ParallelDims",
    "check_divisible",
    "destroy",
    "dims",
    "gather_state_dict",
    "gather_tensors",
    "initialize",
    "is_initialized",
    "manual_seed",
    "merge_state_dicts",
    "mpu",
    "parallelize",
    "partition_dim",
    "rng_tracker_states",
    "set_rng_tracker_states",
    "shard_state_dict",
    "universal_checkpoint_info",
]
