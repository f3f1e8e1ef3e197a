"""Tensor parallelism (megatron-core) applied to swbert models from outside, and its DeepSpeed wiring.

Order of calls in a trainer::

    deepspeed.init_distributed(dist_backend="gloo" or "nccl")
    dims = swbert.parallel.initialize(tp_size, seed)          # groups; dp_size = world / tp_size
    model = swbert.parallel.parallelize(SWBertForMaskedLM(config), tp_size)  # sequence_parallel=...
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=swbert.parallel.mpu())
    loss = engine(**batch).loss                               # vocab-parallel under TP

See docs/parallelism.md.
"""

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
