"""Make megatron-core's tensor-parallel code run on CPU processes (gloo), for tests and CPU users.

megatron-core assumes CUDA in two places that tensor parallelism reaches:

1. Buffers for all-gather / reduce-scatter are allocated with
   `device=torch.cuda.current_device()` (`tensor_parallel.mappings`, the sequence-parallel branch
   of `tensor_parallel.layers`, `utils.GlobalMemoryBuffer`). A CPU-only torch raises there.
2. The RNG tracker (`tensor_parallel.random`) saves and restores CUDA generator states, so
   seeding it (`swbert.parallel.manual_seed`), checkpointing it or `get_cuda_rng_tracker().fork()`
   cannot work. (swbert's own dropout never forks it: see `swbert.parallel.layers.ShardedDropout`.)

`apply()` fixes both without touching torch itself: those megatron modules see a `torch` whose
`cuda.current_device()` is `"cpu"` (everything else is the real torch), and the RNG tracker is
replaced by one that keeps CPU generator states. It does nothing when CUDA is available, so GPU
runs use megatron-core unchanged.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from megatron.core import utils as mcore_utils
from megatron.core.tensor_parallel import layers, mappings, random

_applied = False


class _CPUCuda(types.ModuleType):
    """`torch.cuda`, except that the "current device" is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"


class _TorchOnCPU(types.ModuleType):
    """`torch`, except that `torch.cuda` is `_CPUCuda`."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CPUCuda()

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


class CPURNGStatesTracker(random.CudaRNGStatesTracker):
    """megatron-core's named RNG states, kept as CPU generator states.

    `fork(name)` swaps the named state into the default CPU generator for the duration of the
    block, as megatron's tracker does with the CUDA generator.
    """

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added; call swbert.parallel.manual_seed first")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def apply() -> bool:
    """Patch megatron-core for CPU when CUDA is absent. Idempotent; returns whether it is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        shim = _TorchOnCPU()
        for module in (mappings, layers, mcore_utils):
            module.torch = shim
        random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        _applied = True
    return True
