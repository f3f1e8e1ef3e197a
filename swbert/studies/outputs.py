"""What studies read and write besides their records: a training run's metrics.jsonl, tables as
markdown and CSV, and figures."""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
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


def markdown_table(header: list[str], rows: list[list[str]], padded: bool = False) -> list[str]:
    """A markdown table's lines: numbers right-aligned after the first column, or (`padded`) every
    column as wide as its widest cell, so that it reads as well on a console."""
    widths = [max(len(r[i]) for r in (header, *rows)) if padded else 0 for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in (header, *rows)]
    rule = [f" {'-' * w} " for w in widths] if padded else ["---"] + ["---:"] * (len(header) - 1)
    return [lines[0], "|" + "|".join(rule) + "|", *lines[1:]]


@dataclass
class Table:
    """One table: markdown header/rows (formatted) and CSV header/rows (raw numbers)."""

    title: str
    header: list[str]
    rows: list[list[str]]
    csv_header: list[str]
    csv_rows: list[list[object]]
    note: str = ""  # a line under the markdown table (what a column means, where a number comes from)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", *markdown_table(self.header, self.rows)]
        return "\n".join([*lines, *(["", self.note] if self.note else [])]) + "\n"

    def write(self, out_dir: Path, stem: str) -> None:
        """OUT_DIR/STEM.md and OUT_DIR/STEM.csv."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stem}.md").write_text(self.markdown(), encoding="utf-8")
        with open(out_dir / f"{stem}.csv", "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([self.csv_header, *self.csv_rows])


def pyplot() -> Any:
    """matplotlib's pyplot, drawing without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_axes(
    title: str, xlabel: str, ylabel: str, figsize: tuple[float, float] = (7, 4.5), grid: str = "both"
) -> tuple[Any, Any]:
    """A figure and its axes, labelled, with a light grid on `grid` ("x", "y" or "both")."""
    fig, ax = pyplot().subplots(figsize=figsize)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, axis=grid, which="both", alpha=0.3)
    return fig, ax


def save_figure(fig: Any, path: Path, dpi: int = 150, legend_size: float | None = None) -> Path:
    """Write a figure as a PNG (its folder made), a legend on each of its axes, and free it."""
    for ax in fig.axes:
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
