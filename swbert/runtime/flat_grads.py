"""ZeRO-2 gradients in one flat buffer per parameter group: no per-tensor work in a micro-batch.

DeepSpeed 0.19.8's ZeRO-2 handles every gradient by itself: a hook per parameter copies it into a
bucket during the backward, the end of every micro-batch adds each reduced gradient into the fp32
partition and copies it back (for shared BERT-base: 190 tensors, about 950 small ops a micro-batch),
and the step checks overflow and norm tensor by tensor, with six host syncs. `flatten_gradients`
changes the class of the engine's ZeRO-2 optimizer to `FlatGradZeroOptimizer` (the same object and
state, so checkpoints are unchanged) where it applies (`why_not_flat`: bf16 with fp32 accumulation,
no offload, no round-robin partitioning):

- each parameter's `.grad` is a view into one bf16 buffer per group with the layout of DeepSpeed's
  flat parameter buffer, so autograd accumulates into it in place; DeepSpeed's hooks are removed;
- after a backward, between boundaries: the buffer is added to a full-size fp32 accumulator (one op);
  at the boundary: one reduce-scatter per group, in `communication_data_type`, into this rank's fp32
  gradient partition, the one DeepSpeed's step reads (its compact partition buffer);
- the step: overflow taken from the trainer's agreed flag (`agree_overflow`, or one flat check when
  nobody agreed), the norm in one op over the partition, clipping on the device: no host sync.

Ours, not DeepSpeed's: gradients are reduced once per optimizer step, after the last backward (not
in buckets during each backward), and accumulated in fp32 before that reduction, at the cost of one
fp32 copy of the gradients per rank (4 bytes a parameter) when accumulating. docs/performance.md
gives the figures. `SWBERT_FLAT_GRADS=off` keeps DeepSpeed's own path (for comparison).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)


def why_not_flat(optimizer: Any) -> str | None:
    """None when `FlatGradZeroOptimizer` can take over `optimizer`, else why not (for the log)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer or not optimizer.partition_gradients:
        return "not ZeRO stage 2"
    checks = [
        (optimizer.cpu_offload, "optimizer offload"),
        (optimizer.has_moe_layers, "MoE layers"),
        (optimizer.round_robin_gradients, "round_robin_gradients"),
        (optimizer.sequence_parallel_size != 1, "sequence parallelism"),
        (optimizer.torch_autocast_gradscaler is not None or optimizer.zenflow, "autocast or ZenFlow"),
        (optimizer.dtype == optimizer.gradient_accumulation_dtype, "no separate fp32 accumulation"),
    ]
    for failed, why in checks:
        if failed:
            return why
    for i, group in enumerate(optimizer.bit16_groups):
        if not optimizer._use_compact_grad_partition_buffer(i) or not all(p.requires_grad for p in group):
            return "a frozen parameter or a group without a compact gradient partition"
    return None


def flatten_gradients(engine: Any) -> bool:
    """Give `engine`'s ZeRO-2 optimizer flat gradients where it can (see the module docstring);
    returns whether it did. Call once, right after `deepspeed.initialize`."""
    optimizer = engine.optimizer
    why = "SWBERT_FLAT_GRADS=off" if os.environ.get("SWBERT_FLAT_GRADS") == "off" else why_not_flat(optimizer)
    if why is not None:
        log.info("ZeRO gradients: DeepSpeed's per-tensor path (%s)", why)
        return False
    optimizer.__class__ = FlatGradZeroOptimizer
    optimizer.take_over()
    log.info("ZeRO-2 gradients: one flat buffer per group, reduced once per optimizer step")
    return True


def _import_base() -> type:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


class FlatGradZeroOptimizer(_import_base()):  # type: ignore[misc]
    """DeepSpeed's ZeRO-2 optimizer with flat gradients; made by `flatten_gradients`, never built."""

    def take_over(self) -> None:
        for hook in self._grad_acc_hooks:
            hook.remove()
        self._grad_acc_hooks.clear()
        self.flat_grads = [torch.zeros_like(flat) for flat in self.bit16_groups_flat]
        self.flat_accum: list[torch.Tensor | None] = [None] * len(self.flat_grads)
        self.accumulating = False  # whether flat_accum holds micro-batches of this step
        self.partitions = [self._build_compact_grad_partition_buffer(i) for i in range(len(self.flat_grads))]
        self.agreed_overflow: bool | None = None
        self._point_grads()

    def _point_grads(self) -> None:
        """Every parameter's `.grad`: its place in its group's flat gradient buffer."""
        for group, flat, grads in zip(self.bit16_groups, self.bit16_groups_flat, self.flat_grads):
            base = flat.data_ptr()
            for p in group:
                if p.grad is None:
                    offset = (p.data_ptr() - base) // p.element_size()
                    p.grad = grads.narrow(0, offset, p.numel()).view_as(p)

    # ---- the backward ---------------------------------------------------------------------------
    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        """After each backward: accumulate in fp32 and, at the boundary, reduce into the partition."""
        boundary = self.is_gradient_accumulation_boundary()
        for i, grads in enumerate(self.flat_grads):
            if not boundary:
                if self.flat_accum[i] is None:
                    self.flat_accum[i] = torch.zeros(grads.shape, dtype=torch.float32, device=grads.device)
                self.flat_accum[i].add_(grads)
            else:
                total = self.flat_accum[i].add_(grads) if self.accumulating else grads
                self._reduce_into_partition(i, total)
                if self.accumulating:
                    self.flat_accum[i].zero_()
                self.averaged_gradients[i] = self.partitions[i]
            grads.zero_()
        self.accumulating = not boundary

    def _reduce_into_partition(self, i: int, total: torch.Tensor) -> None:
        from deepspeed import comm as dist

        partition = self.partitions[i].flat_partition
        group = self.real_dp_process_group[i]
        world = dist.get_world_size(group=group)
        if world == 1:
            partition.copy_(total)
            return
        source = total.to(self.communication_data_type)
        if source.dtype == partition.dtype:
            dist.reduce_scatter_tensor(partition, source, group=group)
        else:
            out = torch.empty(partition.shape, dtype=source.dtype, device=source.device)
            dist.reduce_scatter_tensor(out, source, group=group)
            partition.copy_(out)
        if self.gradient_average:
            partition.div_(world)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The flat buffers are zeroed after every backward; the views stay (re-made if dropped)."""
        self._point_grads()

    def free_grad_in_param_list(self, param_list: list) -> None:
        """DeepSpeed's step drops every `.grad` here; the flat views stay."""

    def _update_model_bit16_weights(self, group_index: int) -> None:
        """DeepSpeed re-points every parameter at its flat buffer after each step ("to be safe"),
        three ops a tensor; skipped while every parameter still lies in that buffer."""
        flat = self.bit16_groups_flat[group_index]
        start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        if not all(start <= p.data_ptr() < end for p in self.bit16_groups[group_index]):
            super()._update_model_bit16_weights(group_index)

    # ---- the step -------------------------------------------------------------------------------
    def agree_overflow(self, overflow: bool) -> None:
        """The step's overflow, already agreed over every rank (the trainer's one all-reduce): the
        next `step` skips or applies on it without a check or sync of its own."""
        self.agreed_overflow = bool(overflow)

    def local_nonfinite(self) -> torch.Tensor:
        """Whether this rank's gradient partitions hold an inf or NaN, on the device."""
        flags = [torch.isfinite(part.flat_partition).all() for part in self.partitions]
        return ~torch.stack(flags).all()

    def step(self, closure: Any = None) -> None:
        agreed, self.agreed_overflow = self.agreed_overflow, None
        if agreed is None:  # nobody agreed: DeepSpeed's own checks (flat ones below), with their syncs
            return super().step(closure)
        saved, self.check_grad_overflow = self.check_grad_overflow, agreed
        self.overflow_known = agreed
        try:  # a skipped step takes DeepSpeed's own skip path through `has_overflow`
            return super().step(closure)
        finally:
            self.check_grad_overflow, self.overflow_known = saved, None

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        if getattr(self, "overflow_known", None) is not None:
            return self.overflow_known
        from deepspeed import comm as dist

        overflow = self.local_nonfinite().byte()
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow, op=dist.ReduceOp.MAX)
        return bool(overflow.item())

    def get_grad_norm_direct(self, gradients: Any, params: Any, norm_type: float = 2) -> torch.Tensor:
        """One norm over the flat partition (its padding is zero); -1 when not finite, as DeepSpeed's.
        Under tensor parallelism DeepSpeed's own, which counts a replicated parameter once."""
        flat = getattr(gradients, "flat_partition", None)
        if flat is None or float(norm_type) != 2.0 or self.model_parallel_world_size > 1:
            return super().get_grad_norm_direct(gradients, params, norm_type)
        from deepspeed import comm as dist

        squares = torch.linalg.vector_norm(flat, 2, dtype=torch.float32).square()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        norm = squares.sqrt()
        return norm.masked_fill_(~torch.isfinite(norm), -1.0)

    def unscale_and_clip_grads(self, grad_groups_flat: list, total_norm: torch.Tensor) -> None:
        """DeepSpeed's clipping with the factor kept on the device (an invalid norm clips to zero,
        as DeepSpeed's does) instead of a host check of the norm."""
        if self.clip_grad == 0.0 and self.loss_scale == 1.0:
            return
        combined_scale = self.loss_scale
        if self.clip_grad > 0.0:
            norm = torch.where(torch.isfinite(total_norm) & (total_norm >= 0), total_norm, float("inf"))
            clip = torch.clamp(((norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
            combined_scale = clip * self.loss_scale
        for grad in grad_groups_flat:
            grad.mul_(1.0 / combined_scale)
