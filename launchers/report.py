"""The paper's tables (1 GLUE, 2 SQuAD, 5 noise, 6 cross-domain) and figures (2 pretraining loss,
3 fine-tuning time) from fine-tuning runs in MLflow and pretraining run folders.

    python launchers/report.py --runs-dir runs/glue --out reports/
    MLFLOW_TRACKING_URI=http://mlflow:5000 python launchers/report.py --out reports/
    python launchers/report.py --tracking-uri sqlite:///runs/mlflow.db --parent-run <id> --out reports/
    python launchers/report.py --runs-dir runs/glue --out reports/ \\
        --pretrain-runs standard=runs/base-standard shared=runs/base-shared

Writes <name>.md and <name>.csv for every table with data (plus the .png figures), prints the
markdown, and, when a tracking store is given, logs the folder as the artifacts of a `report` run.
"""

from __future__ import annotations

import sys
import time

from swbert import cli
from swbert.finetune.report import Collected, ReportConfig, build_report, collect

USAGE = (
    "usage: launchers/report.py (--runs-dir DIR | --tracking-uri URI | --pretrain-runs NAME=DIR ...) "
    "--out DIR [--key value ...]"
)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 1 nothing to report; 2 bad input, with a one-line error."""
    cfg = cli.parse_or_exit(ReportConfig, argv, USAGE)
    return cli.exit_on_bad_input(lambda: report(cfg))


def report(cfg: ReportConfig) -> int:
    """Collect, build, print and log the report `cfg` asks for."""
    uri = cfg.uri()
    runs = cfg.pretrain_curves()
    collected = collect(uri, cfg.experiment, cfg.parent_run, missing_ok=bool(runs)) if uri else Collected()
    tables = build_report(
        collected, cfg.out, cfg.stsb_metric, runs, cfg.timing_batch_size, cfg.baseline, cfg.column_order
    )
    if not tables and not runs:
        print(f"no finished fine-tuning runs in experiment {cfg.experiment!r} at {uri}", file=sys.stderr)
        return 1
    for table in tables.values():
        print(table.markdown())
    if runs:
        print(f"Figure 2 (pretraining loss of {', '.join(runs)}): {cfg.out / 'figure2_pretrain_loss.png'}")
    if uri:
        from swbert.studies.tracking import Tracker

        tracker = Tracker(uri, cfg.experiment, system_metrics=False)
        with tracker.sweep(
            f"report-{time.strftime('%Y%m%d-%H%M%S')}", "report", {"out": str(cfg.out)}
        ) as rid:
            tracker.log_artifacts(rid, cfg.out, "report")
        print(f"logged to MLflow ({uri}) as the artifacts of run {rid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
