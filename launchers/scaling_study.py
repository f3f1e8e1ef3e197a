"""Scaling study: parameters, FLOPs, memory by ZeRO stage and compute-optimal tokens for a grid of
sizes x attention variants x parallel layouts, with measured short runs where the machine allows.

    python launchers/scaling_study.py --sizes tiny mini --attention standard shared --layouts z1 z3
    python launchers/scaling_study.py --no-measure --gpus 64            # closed forms for a cluster
    python launchers/scaling_study.py --emit-slurm --nodes 2 --gpus-per-node 8   # a job array
    python launchers/scaling_study.py --collect runs/scaling            # after the job array
    python launchers/scaling_study.py --no-measure --gpus 8 --layouts tp2-z1 tp4-z1 \
        --sequence-parallel false true --activation-checkpointing none full   # how activations are kept
    python launchers/scaling_study.py --quality      # held-out loss of a ladder, fitted (see --quality --help)
    python launchers/scaling_study.py --quality --isoflop-budgets 2e12 4e12 8e12 1.6e13   # isoFLOP profiles

Writes OUTPUT_DIR/scaling.csv, OUTPUT_DIR/plots/*.png and one MLflow run per grid point under a
parent run (MLFLOW_TRACKING_URI, else OUTPUT_DIR/../mlflow.db, shared). Layouts: z0..z3, optionally
with a tensor-parallel size (tp2-z1) and offload (z3-offload: optimizer; z3-offload-params: both),
sequence parallelism (tp2-z1-sp) and activation checkpointing (z1-ac-full, z1-ac-selective);
--sequence-parallel and --activation-checkpointing give every other layout each of their values.
Combinations the trainer refuses (sequence parallelism without tensor parallelism, selective
checkpointing with it) are refused before anything runs.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

from swbert import cli
from swbert.logs import setup_logging
from swbert.scaling.study import StudyConfig, collect, emit_slurm, exit_status, run_study
from swbert.studies.runner import stop_on_sigterm
from swbert.studies.slurm import switch_given

USAGE = "usage: launchers/scaling_study.py [--config FILE] [--key value ...]"


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0; 1 when --collect finds nothing measured; 2 bad input; 3 every measured run failed."""
    argv = sys.argv[1:] if argv is None else argv
    if switch_given(argv, "--quality"):  # the quality study's flags are its own (QualityConfig)
        return quality_main(argv)
    cfg = cli.parse_or_exit(StudyConfig, argv, USAGE)
    setup_logging()  # the console filters pretraining has: libraries' chatter and known noise off
    try:
        if cfg.collect is not None:
            return report_collected(cfg.collect, collect(cfg.collect, cfg.plugins))
        if cfg.emit_slurm:
            sweep, command = emit_slurm(cfg, cfg.nodes, cfg.gpus_per_node)
            print(f"grid written to {sweep}; submit from the repository root with:\n  {command}\n"
                  f"then: python launchers/scaling_study.py --collect {cfg.output_dir}")  # fmt: skip
            return 0
        if cfg.measure and cfg.data_dir is None:  # measured runs read the embedded default corpus
            from data_prep.default_corpus import ensure_default_data

            cfg.data_dir = str(ensure_default_data())
        rows = run_study(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    counts = collections.Counter(row["status"] for row in rows)
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"{len(rows)} grid point(s): {summary}\n  table: {cfg.output_dir / 'scaling.csv'}\n"
          f"  plots: {cfg.output_dir / 'plots'}")  # fmt: skip
    status = exit_status(rows)
    if status:
        print(f"error: every measured run failed; see the reasons in {cfg.output_dir / 'scaling.csv'}",
              file=sys.stderr)  # fmt: skip
    return status


def report_collected(folder: Path, rows: list[dict[str, Any]]) -> int:
    """What --collect found: the table, or that no point has been measured yet (and where it looked)."""
    measured = sum(row["status"] == "measured" for row in rows)
    if not measured:
        print(f"nothing measured: none of the {len(rows)} point(s) of {folder / 'grid.json'} has a "
              f"metrics.jsonl under {folder / 'points'}/; run the job array first ({folder / 'submit.sh'})",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"{measured} of {len(rows)} point(s) measured -> {folder / 'scaling.csv'}")
    return 0


def quality_main(argv: list[str]) -> int:
    """The quality study. Exit status: 0; 2 bad input (before anything trains); 3 every point failed."""
    from swbert.runtime.exits import PREEMPTED_EXIT
    from swbert.scaling.quality import QualityConfig, emit_slurm as emit_quality_slurm, run_quality

    cfg = cli.parse_or_exit(QualityConfig, argv, USAGE.replace("[--config", "--quality [--config"))
    setup_logging()  # the console filters pretraining has: libraries' chatter and known noise off

    def work() -> list:
        stop_on_sigterm()  # the point in flight checkpoints before the study exits
        if cfg.data_dir is None:  # the embedded default corpus (it has a validation split)
            from data_prep.default_corpus import ensure_default_data

            cfg.data_dir = str(ensure_default_data())
        if cfg.emit_slurm:
            submit, command, collect = emit_quality_slurm(cfg, argv, cfg.read_data(held_out=True)[1])
            print(f"{submit} written; submit from the repository root with:\n  {command}\nthen: {collect}")
            return []
        return run_quality(cfg)

    rows = cli.exit_on_bad_input(work)
    if cfg.emit_slurm:
        return 0
    if cfg.point_index is not None:  # an array task: 75 asks SLURM to run it again (it resumes)
        (row,) = rows
        return {"done": 0, "stopped": PREEMPTED_EXIT}.get(row["status"], 3)
    done = sum(r["status"] == "done" for r in rows)
    out = cfg.output_dir
    fits = out / ("isoflop.json" if cfg.isoflop_budgets else "fits.json")
    print(f"{done} of {len(rows)} point(s) done\n  fits: {fits}\n  table: {out / 'points.csv'}\n"
          f"  plots: {out / 'plots'}")  # fmt: skip
    if rows and not done:
        print(f"error: every point failed; see the reasons in {out / 'points.csv'}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
