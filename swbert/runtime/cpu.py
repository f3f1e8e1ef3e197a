"""CPU speed-ups, applied from outside the model, and the CPU process settings.

The model (`swbert.models`) is one path for every device: PyTorch's own dropout, SDPA and linear
layers, what a GPU runs. On a CPU some of those ops are slow for reasons that have nothing to do
with the model, so `optimize_for_cpu` swaps in kernels that compute the same thing faster, the way
torchtitan's float8 converter or Megatron's layer specs swap modules:

    attention  SDPAKernel -> CPUAttentionKernel: in training with attention dropout, batched matrix
               products with the padding mask as an additive bias and a bool dropout mask drawn
               cheaply (PyTorch has no fused CPU kernel with dropout; SDPA's math fallback keeps
               scaled copies of Q and K and a float mask)

A swap changes a module's class to a subclass that adds no state: parameters, buffers, hooks,
ties and state-dict keys stay as they were, so a checkpoint saved with the kernels on loads into
the plain model and back. A kernel stays only while it is worth at least 3% of a training step
(`benchmarks/train_step.py`, docs/performance.md: a cheaper dropout module and a vocabulary-blocked
decoder were measured below that and removed). Each kernel is held equal to the plain path
(outputs and gradients) in tests/models/test_cpu_kernels.py. The trainer applies them when `cpu_kernels`
is `auto` (CPU without torch.compile) or `on`; `off` runs exactly what a GPU runs.

The process settings a CPU run needs (threads per rank, the allocator) live here too, so that
everything device-specific is in one module.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from swbert.data.loader import rank_cpus
from swbert.models.attention import SDPAKernel

CPU_KERNELS: tuple[str, ...] = ("attention",)
CPUKernels = Literal["auto", "on", "off"]


# ---- dropout for the attention kernel ----------------------------------------------------------
class _BoolMaskDropout(torch.autograd.Function):
    """Dropout whose mask comes from 16-bit random integers, four to one 64-bit draw (about a third
    of the time of PyTorch's CPU dropout).

    On CPU, `bernoulli_` draws a double per element (two 32-bit generator calls) and dropout
    multiplies by a float mask; here one 64-bit draw gives four elements their 16-bit uniforms and
    `torch.where` applies a bool mask (multiplying a float by a bool tensor goes through a slow
    type-promoting loop). The drop probability is p rounded to a multiple of 2^-16 (0.1 becomes
    0.1000061), and the scale is 1 / (1 - that), so the expectation stays exact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        threshold = min(round(p * 2**16), 2**16 - 1)  # p just below 1 still keeps something
        words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # all 64 bits
        uniform16 = words.view(torch.int16)[: x.numel()].view(x.shape)  # uniform on [-2^15, 2^15)
        keep = uniform16 >= threshold - 2**15  # P(keep) = 1 - threshold / 2^16
        scale = 1.0 / (1.0 - threshold / 2**16)
        ctx.save_for_backward(keep)  # a bool mask: 1 byte per element
        ctx.scale = scale
        return torch.where(keep, x, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, 0.0).mul_(ctx.scale), None


def bool_mask_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout with a bool mask for backward, drawn cheaply (`_BoolMaskDropout`)."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    return _BoolMaskDropout.apply(x, p)


# ---- attention ----------------------------------------------------------------------------------
def unfused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """Softmax attention from batched matrix products, for where no fused kernel applies.

    It computes what SDPA's math fallback computes but keeps less for backward: no scaled copies of
    Q and K (1/sqrt(Dh) rides on the product) and a bool dropout mask. Head-major inputs (contiguous
    (B, H, S, Dh)) are read in place; others are copied once (once for K and V when they are one
    tensor, as in shared attention).
    """
    B, H, S, Dh = q.shape
    Sk = k.shape[-2]
    kf = k.reshape(B * H, Sk, Dh)  # views when head-major
    qf = q.reshape(B * H, S, Dh)
    vf = kf if v is k else v.reshape(B * H, Sk, Dh)
    if mask is None:
        bias, beta = qf.new_empty(1, 1, 1), 0.0  # beta=0: baddbmm does not read it
    else:
        # The mask enters as an additive bias that the product accumulates onto (half the time of
        # filling the scores in place, and nothing to undo in backward). The most negative finite
        # value rather than -inf: a query whose keys are all masked gets uniform weights instead of
        # NaN (key padding never masks every key of a real sequence); a finite score added to it
        # rounds back to it.
        mask = mask.expand(B, H, mask.shape[-2], Sk)
        lowest = torch.finfo(qf.dtype).min
        if torch.is_autocast_enabled(qf.device.type):  # the product runs in the autocast dtype
            lowest = max(lowest, torch.finfo(torch.get_autocast_dtype(qf.device.type)).min)
        bias = qf.new_zeros(mask.shape).masked_fill_(~mask, lowest)
        bias, beta = bias.view(B * H, -1, Sk), 1.0
    scores = torch.baddbmm(bias, qf, kf.transpose(1, 2), beta=beta, alpha=Dh**-0.5)  # (B*H, S, Sk)
    probs = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        probs = bool_mask_dropout(probs, dropout_p)
    return torch.bmm(probs, vf).view(B, H, S, Dh)


class CPUAttentionKernel(SDPAKernel):
    """SDPA, except in training with attention dropout on a CPU: PyTorch has no fused CPU kernel
    with dropout and falls back to its math path; `unfused_attention` computes the same faster."""

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # the dense kernel, so an unpadded stream's per-sequence reference runs this too
        if self.training and self.dropout > 0.0 and q.device.type == "cpu":
            return unfused_attention(q, k, v, mask, self.dropout)
        return super().dense(q, k, v, mask)


# ---- applying them ------------------------------------------------------------------------------
def _swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Give `module` a subclass of its own class that adds no state (see the module docstring)."""
    assert issubclass(cls, type(module)), (cls, type(module))
    module.__class__ = cls


def optimize_for_cpu(model: nn.Module, kernels: Iterable[str] = CPU_KERNELS) -> list[str]:
    """Swap the CPU kernels named in `kernels` into `model`, in place; returns those applied.

    Call it after tensor parallelism (`swbert.parallel.parallelize`, whose wrappers keep the kernel
    module) and before the engine wraps the model. Eager mode only: under torch.compile the compiler generates its own kernels.
    """
    kernels = list(kernels)
    unknown = sorted(set(kernels) - set(CPU_KERNELS))
    if unknown:
        raise ValueError(f"unknown CPU kernels {unknown}; choose from {', '.join(CPU_KERNELS)}")
    applied: set[str] = set()
    for module in model.modules():
        if "attention" in kernels and type(module) is SDPAKernel:
            _swap_class(module, CPUAttentionKernel)
            applied.add("attention")
    return [k for k in CPU_KERNELS if k in applied]


def resolve_cpu_kernels(setting: CPUKernels, on_gpu: bool, compile: bool) -> bool:
    """Whether a run applies the CPU kernels: `auto` on a CPU in eager mode; errors name the key."""
    if setting == "on" and on_gpu:
        raise ValueError(
            "cpu_kernels: on, but this run is on a GPU: the CPU kernels are for CPU runs; "
            "use --cpu-kernels auto (or off)"
        )
    if setting == "on" and compile:
        raise ValueError(
            "cpu_kernels: on with compile: true: torch.compile generates its own kernels and the CPU "
            "kernels are eager-mode code; use --cpu-kernels auto (or off) with --compile on"
        )
    return setting == "on" or (setting == "auto" and not on_gpu and not compile)


# ---- process settings ---------------------------------------------------------------------------
def set_cpu_threads(requested: int | None) -> None:
    """Ranks sharing a CPU machine split its cores instead of oversubscribing them: `requested`
    threads, or this rank's share of the CPUs its process may run on (`rank_cpus`)."""
    if torch.cuda.is_available():
        return
    torch.set_num_threads(requested or rank_cpus())


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """CPU training: let glibc keep freed memory for reuse instead of handing it back to the OS.

    A training step allocates and frees the same large tensors every step (activations, gradients,
    the (vocab, d) gradient of the word embedding). glibc serves blocks above its mmap threshold
    (at most 32 MiB by its own adjustment) with fresh pages and unmaps them when freed, so every
    step page-faults and zero-fills them again: about 50,000 faults (200 MB) a step at BERT-base,
    batch 8. With both thresholds raised, freed blocks stay in the heap and are reused, as CUDA's
    caching allocator does on a GPU and jemalloc or tcmalloc setups do for CPU PyTorch; the
    process keeps its peak resident size. Off with SWBERT_CPU_MALLOC=system (or when another
    allocator is preloaded, which ignores mallopt). Returns whether glibc took the setting.
    """
    if os.environ.get("SWBERT_CPU_MALLOC", "keep") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 when it accepts a value; older glibc caps the mmap threshold lower
    mmap_ok = any(libc.mallopt(_M_MMAP_THRESHOLD, limit) == 1 for limit in (1 << 30, 32 << 20))
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    return mmap_ok and trim_ok
