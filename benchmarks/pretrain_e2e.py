"""Tokens/s of each attention variant through the real pretraining job (DeepSpeed, 2 ranks, ZeRO-2).

Every run is `launchers/pretrain.py` under torchrun, exactly as a user starts it; the throughput is
the trainer's own `tokens_per_s` from `metrics.jsonl` (data loading, masking, the DeepSpeed engine,
gradient all-reduce and optimizer included; evaluation and checkpointing excluded). The first
logged window of every run is warm-up and dropped. Variants run in rounds, the order rotating
every round, and the median over the rounds' windows is reported:

    python benchmarks/pretrain_e2e.py                          # BERT-base, seq 128, 2 CPU ranks
    python benchmarks/pretrain_e2e.py --size mini --rounds 3
    python benchmarks/pretrain_e2e.py --smoke                  # one tiny run of 4 steps (the tests)

On CPU it sets DS_ACCELERATOR=cpu (gloo); on a GPU machine pass --nproc to use more devices.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS: tuple[str, ...] = ("standard", "shared", "symmetric", "pairwise")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="base")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--nproc", type=int, default=2, help="ranks (data parallel)")
    p.add_argument("--train-steps", type=int, default=12, help="steps per run")
    p.add_argument("--log-interval", type=int, default=3, help="steps per throughput window")
    p.add_argument("--rounds", type=int, default=2, help="runs of every variant, interleaved")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--config", default="default", help="recipe the overrides apply to")
    p.add_argument("--deepspeed-config", default="ds_configs/zero2.json")
    p.add_argument("--output-dir", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--smoke", action="store_true", help="tiny shape, a few steps, one round")
    p.add_argument("extra", nargs="*", help="further --key value overrides for the launcher (after --)")
    args = p.parse_args(argv)
    if args.smoke:  # one short run: the launch (imports, process group) is most of it
        args.size, args.seq_len, args.micro_batch = "tiny", 32, 2
        args.train_steps, args.log_interval, args.rounds = 4, 2, 1
        args.variants = "shared"
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.train_steps < 2 * args.log_interval:
        p.error("--train-steps must cover at least two --log-interval windows (the first is warm-up)")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, variant: str, out: Path) -> list[dict]:
    """One pretraining run; returns its metrics records."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "launchers/pretrain.py",
        "--config",
        args.config,
        "--size",
        args.size,
        "--attention-type",
        variant,
        "--seq-len",
        str(args.seq_len),
        "--micro-batch-size",
        str(args.micro_batch),
        "--global-batch-size",
        str(args.micro_batch * args.nproc),
        "--train-steps",
        str(args.train_steps),
        "--warmup-steps",
        "1",
        "--log-interval",
        str(args.log_interval),
        "--eval-interval",
        str(10 * args.train_steps),  # only the final evaluation, after the last window
        "--eval-batches",
        "1",
        "--save-interval",
        str(10 * args.train_steps),  # only the final checkpoint, after the last window
        "--deepspeed-config",
        args.deepspeed_config,
        "--output-dir",
        str(out),
        "--mlflow",
        "false",
        "--export",
        "false",
        "--progress-bar",
        "false",
        *args.extra,
    ]
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(
            f"pretraining run for {variant} failed (exit {result.returncode}):\n"
            f"{' '.join(cmd)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    root = args.output_dir or Path(tempfile.mkdtemp(prefix="swbert-e2e-"))
    windows: dict[str, list[float]] = {v: [] for v in args.variants}
    losses: dict[str, float] = {}
    waits: dict[str, list[tuple[float, float]]] = {v: [] for v in args.variants}  # (data wait, step) s
    for rnd in range(args.rounds):
        k = rnd % len(args.variants)
        for variant in args.variants[k:] + args.variants[:k]:
            t0 = time.perf_counter()
            records = [r for r in launch(args, variant, root / f"{variant}-{rnd}") if "tokens_per_s" in r]
            if len(records) < 2:
                raise RuntimeError(f"{variant}: expected at least two logged windows, got {len(records)}")
            windows[variant] += [r["tokens_per_s"] for r in records[1:]]  # the first window is warm-up
            waits[variant] += [(r.get("data_wait_s", 0.0), r.get("step_s", 0.0)) for r in records[1:]]
            losses[variant] = records[-1]["loss"]
            print(
                f"round {rnd} {variant:<10} windows {[round(r['tokens_per_s'], 1) for r in records]} tokens/s "
                f"(run {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    tokens_per_s = {v: statistics.median(w) for v, w in windows.items()}
    print(
        f"# {args.size}, seq {args.seq_len}, micro-batch {args.micro_batch} x {args.nproc} ranks, "
        f"{args.deepspeed_config}, {args.train_steps} steps/run, median of {args.rounds} rounds"
    )
    # the share of the training time the step loop waited for batches (the loader's cost)
    data_wait = {
        v: sum(w for w, _ in waits[v]) / max(sum(s for _, s in waits[v]), 1e-9) for v in args.variants
    }
    print(f"{'variant':<10} {'tokens/s':>10} {'windows':>8} {'last loss':>10} {'data wait':>10}")
    for v in args.variants:
        print(
            f"{v:<10} {tokens_per_s[v]:>10.1f} {len(windows[v]):>8} {losses[v]:>10.3f} {data_wait[v]:>10.2%}"
        )
    ratios = {}
    if "standard" in tokens_per_s:
        for v in args.variants:
            if v != "standard":
                ratios[f"{v}/standard"] = tokens_per_s[v] / tokens_per_s["standard"]
                print(f"{v}/standard throughput {ratios[f'{v}/standard']:.3f}x")
    out = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "tokens_per_s": tokens_per_s,
        "windows": windows,
        "ratios": ratios,
        "data_wait_fraction": data_wait,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
