"""Scaling study: parameters, FLOPs, memory by ZeRO stage and compute-optimal tokens for a grid of
sizes x attention variants x parallel layouts, with measured short runs where the machine allows.

    python launchers/scaling_study.py --sizes tiny mini --attention standard shared --layouts z1 z3
    python launchers/scaling_study.py --no-measure --gpus 64            # closed forms for a cluster
    python launchers/scaling_study.py --emit-slurm --nodes 2 --gpus-per-node 8   # a job array
    python launchers/scaling_study.py --collect runs/scaling            # after the job array

Writes OUTPUT_DIR/scaling.csv, OUTPUT_DIR/plots/*.png and one MLflow run per grid point under a
parent run (MLFLOW_TRACKING_URI, else sqlite:///OUTPUT_DIR/mlflow.db). Layouts: z0..z3, optionally
with a tensor-parallel size (tp2-z1) and offload (z3-offload: optimizer; z3-offload-params: both).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from swbert.models.config import ATTENTION_TYPES, SIZES
from swbert.scaling.study import StudyConfig, collect, emit_slurm, run_study


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=Path("runs/scaling"))
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["tiny", "mini", "small", "base", "large", "xl"],
        help=f"named sizes ({', '.join(SIZES)})",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["standard", "shared"],
        help=f"attention variants ({', '.join(ATTENTION_TYPES)})",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["z0", "z1", "z2", "z3", "z3-offload"],
        help="parallel layouts: z0..z3, tpN-zK, z3-offload, z3-offload-params",
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="auto: fp32 when measuring on CPU, else bf16",
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="devices the closed forms assume (default: --nproc)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes of each measured run on this machine")
    parser.add_argument("--no-measure", action="store_true", help="closed forms only")
    parser.add_argument(
        "--measure-max-params",
        type=float,
        default=math.inf,
        help="measure only points up to this many parameters",
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps of a measured run")
    parser.add_argument("--data-dir", default=None, help="shards (default: the embedded default corpus)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary of the closed forms (default: the data's when measuring, else 30522)",
    )
    parser.add_argument("--point-timeout", type=float, default=1800, help="seconds per measured run")
    parser.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="host memory measured runs may use (default: what is available)",
    )
    parser.add_argument(
        "--nvme-path",
        type=Path,
        default=None,
        help="swap folder for *-nvme layouts, on a fast local disk (default: OUTPUT_DIR/nvme)",
    )
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the measured runs' checkpoints")
    parser.add_argument("--experiment", default="swbert-scaling", help="MLflow experiment")
    parser.add_argument("--emit-slurm", action="store_true", help="write the grid as a SLURM job array")
    parser.add_argument("--nodes", type=int, default=1, help="with --emit-slurm: nodes per grid point")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="with --emit-slurm; 0: CPU nodes with one process each"
    )
    parser.add_argument(
        "--collect",
        type=Path,
        default=None,
        metavar="DIR",
        help="tabulate a job array's results from DIR (written by --emit-slurm)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.collect is not None:
            rows = collect(args.collect)
            print(f"{len(rows)} point(s) -> {args.collect / 'scaling.csv'}")
            return
        cfg = StudyConfig(
            output_dir=args.output_dir, sizes=args.sizes, attentions=args.attention, layouts=args.layouts,
            seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision, gpus=args.gpus,
            nproc=args.nproc, measure=not args.no_measure, measure_max_params=args.measure_max_params,
            steps=args.steps, data_dir=args.data_dir, vocab_size=args.vocab_size,
            point_timeout_s=args.point_timeout, memory_limit_gib=args.memory_limit_gib,
            nvme_path=args.nvme_path, keep_checkpoints=args.keep_checkpoints,
            experiment=args.experiment,
        )  # fmt: skip
        if args.emit_slurm:
            sweep, command = emit_slurm(cfg, args.nodes, args.gpus_per_node)
            print(f"grid written to {sweep}; submit from the repository root with:\n  {command}\n"
                  f"then: python launchers/scaling_study.py --collect {args.output_dir}")  # fmt: skip
            return
        rows = run_study(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"{len(rows)} grid point(s): {summary}\n  table: {args.output_dir / 'scaling.csv'}\n"
          f"  plots: {args.output_dir / 'plots'}")  # fmt: skip


if __name__ == "__main__":
    main()
