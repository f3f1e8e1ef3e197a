"""Turn fine-tuning runs in MLflow into the paper's tables (1 GLUE, 2 SQuAD, 5 noise, 6 cross-domain).

    python launchers/report.py --runs-dir runs/glue --out reports/
    MLFLOW_TRACKING_URI=http://mlflow:5000 python launchers/report.py --out reports/
    python launchers/report.py --tracking-uri sqlite:///runs/glue/mlflow.db --parent-run <id> --out reports/

Writes <table>.md and <table>.csv for every table with data (plus table5_noise.png) and prints the
markdown. Variants are rows; numbers are medians over seeds at the best learning rate.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from swbert.finetune.report import build_report, collect
from swbert.finetune.tracking import DEFAULT_EXPERIMENT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else --runs-dir's mlflow.db)"
    )
    src.add_argument("--runs-dir", type=Path, help="a launcher's --output-dir holding mlflow.db")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT)
    p.add_argument("--parent-run", nargs="+", help="only runs under these sweep (parent) run ids")
    p.add_argument("--out", type=Path, required=True, help="folder for the .md/.csv/.png files")
    args = p.parse_args(argv)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if args.runs_dir:
        db = args.runs_dir / "mlflow.db"
        if not db.is_file():
            p.error(f"--runs-dir {args.runs_dir}: no mlflow.db there")
        uri = f"sqlite:///{db.resolve()}"
    if not uri:
        p.error("say where the runs are: --runs-dir, --tracking-uri or MLFLOW_TRACKING_URI")
    tables = build_report(collect(uri, args.experiment, args.parent_run), args.out)
    if not tables:
        print(f"no finished fine-tuning runs in experiment {args.experiment!r} at {uri}", file=sys.stderr)
        return 1
    for table in tables.values():
        print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
