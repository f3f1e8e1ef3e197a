"""Turn fine-tuning runs in MLflow into the paper's tables (1 GLUE, 2 SQuAD, 5 noise, 6 cross-domain).

    python launchers/report.py --runs-dir runs/glue --out reports/
    MLFLOW_TRACKING_URI=http://mlflow:5000 python launchers/report.py --out reports/
    python launchers/report.py --tracking-uri sqlite:///runs/glue/mlflow.db --parent-run <id> --out reports/

Writes <table>.md and <table>.csv for every table with data (plus table5_noise.png) and prints the
markdown. Variants are rows; numbers are medians over seeds at the best learning rate.
"""

from __future__ import annotations

import sys

from swbert import cli
from swbert.finetune.report import ReportConfig, build_report, collect

USAGE = "usage: launchers/report.py (--runs-dir DIR | --tracking-uri URI) --out DIR [--key value ...]"


def main(argv: list[str] | None = None) -> int:
    cfg = cli.parse_or_exit(ReportConfig, argv, USAGE)
    try:
        uri = cfg.uri()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    tables = build_report(collect(uri, cfg.experiment, cfg.parent_run), cfg.out)
    if not tables:
        print(f"no finished fine-tuning runs in experiment {cfg.experiment!r} at {uri}", file=sys.stderr)
        return 1
    for table in tables.values():
        print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
