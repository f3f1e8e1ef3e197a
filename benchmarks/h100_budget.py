"""An H100 time budget per encoder layer and the MFU it implies, per attention variant: an estimate
to check against a measurement, not one.

    python benchmarks/h100_budget.py                        # BERT-base, seq 128, 8 x H100 SXM, ZeRO-2
    python benchmarks/h100_budget.py --eager --seq-len 512  # without torch.compile's fusions

Every figure comes from a named assumption (the flags): GEMMs at a fraction of the bf16 peak,
flash attention at a lower one, elementwise work as passes over (tokens x d) bf16 tensors at a
fraction of HBM bandwidth, ZeRO-2's gradient reduce-scatter over NVLink hidden behind the part of
the backward that runs after the first gradient is ready (measured: FIRST_REDUCE_AT), its last
bucket and the parameter all-gather after the optimizer step not hidden, and the loader's rate
against the step's demand.
FLOPs and parameters are swbert's own (`swbert.models.flops`, the variant classes), so the
variants differ exactly as the models do. What confirms it on a GPU (docs/performance.md):
`benchmarks/train_step.py --device cuda` (eager and `--compile`) and the trainer's `mfu` field.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swbert.models import SWBertConfig  # noqa: E402
from swbert.models.attention import attention_types, meta_attention  # noqa: E402
from swbert.models.flops import masked_lm_flops, masked_lm_params  # noqa: E402

# Passes over a (tokens x d) bf16 tensor per layer, forward, by the elementwise ops around the
# GEMMs: 2 LayerNorms (read + write), 2 dropouts (read, write, a 1-byte mask), 2 residual adds
# (2 reads, 1 write), GELU on the 4d MLP activation (read + write 4d). Backward is about twice
# the forward. torch.compile fuses dropout, residual and LayerNorm into one pass each block, and
# GELU into its GEMM's epilogue: about half the traffic.
EAGER_PASSES = 2 * 2 + 2 * 2.5 + 2 * 3 + 8
COMPILED_PASSES = EAGER_PASSES / 2
SHARED_EXTRA_PASSES = 2  # Q = S * (dq * dk): one read, one write (dv rides in the output weight)
# The halving above is an assumption no CPU test measures (inductor's CPU kernels are not a GPU's);
# what tests it is a GPU's own figure: the GPU window's trainer MFU (benchmarks/gpu_window.py), or
# benchmarks/train_step.py --device cuda with and without --compile.

# When ZeRO's first gradient reduce can start, as a share of the backward's wall time, for each way
# of running the model: measured by benchmarks/compile_overlap.py (ZeRO-2 on gloo, one process,
# 6 layers, d = 256, seq 128, batch 8; CPU, docs/performance.md "An H100 time budget"), and held by tests/training/test_compile.py (per block: under half). Gradient
# communication can hide behind the rest of the backward, 1 - share: 95% compiled per block (what
# `--compile auto` runs on a GPU), 96% eager, 17% compiled as one graph (DeepSpeed's
# engine.compile), whose backward holds every gradient hook to its end. `--first-reduce-json` takes
# a fresh measurement (compile_overlap.py --json).
FIRST_REDUCE_AT = {"eager": 0.035, "per_block": 0.053, "whole_model": 0.829}
DS_CONFIG = Path(__file__).resolve().parents[1] / "ds_configs" / "zero2.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="base")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=256, help="sequences per GPU per step")
    p.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs (one NVLink node)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM)")
    p.add_argument("--gemm-efficiency", type=float, default=0.70, help="GEMMs' share of the peak at d=768")
    p.add_argument("--attention-efficiency", type=float, default=0.40, help="flash attention's share")
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM3 bandwidth, TB/s")
    p.add_argument("--memory-efficiency", type=float, default=0.75, help="share of HBM elementwise ops reach")
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="NVLink bandwidth per GPU and direction")
    p.add_argument(
        "--first-reduce-at",
        type=float,
        default=None,
        help="share of the backward before ZeRO's first gradient reduce (default: FIRST_REDUCE_AT, measured)",
    )
    p.add_argument(
        "--first-reduce-json",
        type=Path,
        default=None,
        help="the shares from a compile_overlap.py --json file",
    )
    p.add_argument(
        "--ds-config", type=Path, default=DS_CONFIG, help="DeepSpeed JSON whose reduce_bucket_size to use"
    )
    p.add_argument(
        "--loader-samples-per-s", type=float, default=None, help="loader rate (one worker x workers)"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="no torch.compile fusions")
    mode.add_argument(
        "--whole-model",
        action="store_true",
        help="compiled as one graph: the fusions, every reduce after the backward",
    )
    return p.parse_args(argv)


def compile_mode(args: argparse.Namespace) -> str:
    return "eager" if args.eager else ("whole_model" if args.whole_model else "per_block")


def first_reduce_at(args: argparse.Namespace) -> float:
    """The share of the backward before the first gradient reduce: the flag, else the measurement."""
    if args.first_reduce_at is not None:
        return args.first_reduce_at
    if args.first_reduce_json is not None:
        measured = json.loads(args.first_reduce_json.read_text())
        return measured[compile_mode(args)]["first_reduce_fraction"]
    return FIRST_REDUCE_AT[compile_mode(args)]


def reduce_bucket(args: argparse.Namespace) -> int:
    """Gradient elements per reduce (`zero_optimization.reduce_bucket_size`; DeepSpeed's default 5e8)."""
    return int(json.loads(args.ds_config.read_text())["zero_optimization"].get("reduce_bucket_size", 5e8))


def budget(args: argparse.Namespace, variant: str) -> dict[str, float]:
    """Milliseconds per layer per training step on one GPU, and the step's MFU."""
    config = SWBertConfig.from_size(args.size, attention_type=variant)
    d, f, s = config.hidden_size, config.intermediate_size, args.seq_len
    tokens = args.micro_batch * s
    attn = meta_attention(config)
    gemm_flops = (
        3 * tokens * (2 * attn.projection_weights() + attn.extra_flops_per_token() + 2 * d * d + 4 * d * f)
    )
    # flash attention: QK^T and AV forward (4 s d per token), backward ~2.5x with the recomputation
    attention_flops = 3.5 * tokens * 4 * s * d
    passes = COMPILED_PASSES if not args.eager else EAGER_PASSES
    passes += SHARED_EXTRA_PASSES if variant == "shared" else 0
    elementwise_bytes = 3 * passes * tokens * d * 2  # forward + twice that backward, bf16
    peak = args.peak_tflops * 1e12
    ms = {
        "gemm": 1e3 * gemm_flops / (peak * args.gemm_efficiency),
        "attention": 1e3 * attention_flops / (peak * args.attention_efficiency),
        "elementwise": 1e3 * elementwise_bytes / (args.hbm_tbps * 1e12 * args.memory_efficiency),
    }
    layers = config.num_hidden_layers
    # the MLM head on the predicted positions (transform + the 30k-way decoder), outside the layers
    head_flops = 3 * tokens * 0.15 * (2 * d * d + 2 * d * config.vocab_size)
    head_ms = 1e3 * head_flops / (peak * args.gemm_efficiency)
    compute = layers * sum(ms.values()) + head_ms
    # ZeRO-2, ring over the node: reduce-scatter the bf16 gradients, all-gather the bf16 parameters
    params = masked_lm_params(config)
    collective_ms = 1e3 * (args.gpus - 1) / args.gpus * params * 2 / (args.nvlink_gbps * 1e9)  # each
    # The reduce-scatter runs beside the backward from its first ready gradient on (the window),
    # bucket by bucket; the last, partial bucket is reduced after the backward ends. The all-gather
    # of the updated parameters follows the optimizer step: nothing runs beside it.
    window_ms = (1 - first_reduce_at(args)) * compute * 2 / 3  # backward: 2 of the step's 3 passes
    bucket = reduce_bucket(args)
    last_bucket = (params - 1) % bucket + 1
    full_buckets_ms = collective_ms * (1 - last_bucket / params)
    exposed = collective_ms + collective_ms * last_bucket / params + max(0.0, full_buckets_ms - window_ms)
    ms["communication"] = exposed / layers
    step = compute + exposed
    demand = args.micro_batch / (step / 1e3)  # samples/s one GPU consumes
    ms["data"] = 0.0
    if args.loader_samples_per_s is not None and args.loader_samples_per_s < demand:
        ms["data"] = (args.micro_batch / args.loader_samples_per_s * 1e3 - step) / layers
        step = args.micro_batch / args.loader_samples_per_s * 1e3
    model_flops = tokens * masked_lm_flops(config, s).training
    return {
        **ms,
        "head_ms": head_ms,
        "step_ms": step,
        "mfu": model_flops / (step / 1e3) / peak,
        "samples_per_s": demand,
        "hidden": 1 - exposed / (2 * collective_ms),  # share of ZeRO-2's traffic behind the backward
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mode = {"eager": "eager", "per_block": "compiled per block", "whole_model": "compiled whole"}
    print(
        f"# {args.size}, seq {args.seq_len}, micro-batch {args.micro_batch}, {args.gpus} GPUs, "
        f"{mode[compile_mode(args)]}; GEMM {args.gemm_efficiency:.0%} and attention "
        f"{args.attention_efficiency:.0%} of {args.peak_tflops:g} TFLOP/s, elementwise at "
        f"{args.memory_efficiency:.0%} of {args.hbm_tbps} TB/s, ZeRO-2's first reduce at "
        f"{first_reduce_at(args):.1%} of the backward, {reduce_bucket(args) / 1e6:g}M-element buckets"
    )
    print(f"{'':<10} {'ms per layer per step':^39} {'':>8}")
    print(f"{'variant':<10} {'GEMM':>7} {'attn':>7} {'elem':>7} {'comm':>7} {'data':>7} "
          f"{'head ms':>8} {'step ms':>8} {'MFU':>6} {'samples/s':>10} {'hidden':>7}")  # fmt: skip
    for variant in attention_types():
        b = budget(args, variant)
        print(
            f"{variant:<10} {b['gemm']:>7.3f} {b['attention']:>7.3f} {b['elementwise']:>7.3f} "
            f"{b['communication']:>7.3f} {b['data']:>7.3f} {b['head_ms']:>8.2f} {b['step_ms']:>8.1f} {b['mfu']:>6.1%} "
            f"{b['samples_per_s']:>10,.0f} {b['hidden']:>7.0%}"
        )


if __name__ == "__main__":
    main()
