"""What studies read and write besides their records: a training run's metrics.jsonl, tables as
CSV, and figures."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("swbert.studies")


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A training run's metrics.jsonl as {step: its last record} (a resumed run logs steps again). A
    torn last line (a run cut off while writing) is left out; any other bad line is an error."""
    path = Path(run_dir) / "metrics.jsonl"
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                log.warning("%s, line %d: a torn last line, left out (%.60s)", path, n, line)
                continue
            raise ValueError(
                f"{path}, line {n}: not JSON ({e}); is it a training run's metrics.jsonl?"
            ) from e
        by_step[int(record["step"])] = record
    return dict(sorted(by_step.items()))


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """One row per dict; the columns are the union of all rows' keys, in first-seen order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()  # an absent or None value: an empty cell
        writer.writerows({k: v for k, v in row.items() if v is not None} for row in rows)
    return path


def pyplot() -> Any:
    """matplotlib's pyplot, drawing without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 150) -> Path:
    """Write a figure as a PNG (its folder made) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
