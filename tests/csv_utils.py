"""Reading back the CSV tables the studies write."""

from __future__ import annotations

import csv
from pathlib import Path


def read_csv(path: Path) -> list[dict[str, str]]:
    """The table's rows, each a dict of its header's columns (every value a string)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
