"""The study's table (CSV) and plots: throughput, memory and loss against size, shared vs standard."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from swbert.models.attention import attention_types
from swbert.studies.outputs import pyplot, save_figure

# Line styles given to the attention variants in registration order (standard dashed, shared solid,
# symmetric dotted, pairwise dash-dot), cycling for any registered after them.
LINE_STYLES = ("--", "-", ":", "-.")


def line_style(attention: str) -> str:
    """The variant's line style; solid for a name not registered in this process (an old CSV's)."""
    names = attention_types()
    return LINE_STYLES[names.index(attention) % len(LINE_STYLES)] if attention in names else "-"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _series(
    rows: list[dict[str, Any]], key: str, group: tuple[str, ...]
) -> dict[tuple, list[tuple[float, float]]]:
    """{group values: [(params, value), ...]} over the rows that have `key`, sorted by size."""
    out: dict[tuple, list[tuple[float, float]]] = {}
    for row in rows:
        value = row.get(key)
        if value is None or value == "":
            continue
        out.setdefault(tuple(row[g] for g in group), []).append((float(row["params"]), float(value)))
    return {k: sorted(v) for k, v in sorted(out.items())}


def plot(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """throughput.png, memory.png, loss.png (only those with data); returns the files written."""
    written = []
    measured = [r for r in rows if r.get("status") == "measured"]

    def axes(title: str, ylabel: str):
        fig, ax = pyplot().subplots(figsize=(7, 4.5))
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        return fig, ax

    def save(fig, ax, name: str) -> None:
        ax.legend(fontsize=7)
        written.append(save_figure(fig, folder / name, dpi=120))

    tput = _series(measured, "tokens_per_s", ("attention", "layout"))
    if tput:
        fig, ax = axes("Measured training throughput", "tokens / s")
        ax.set_yscale("log")
        for (attention, layout), pts in tput.items():
            ax.plot(*zip(*pts), line_style(attention), marker="o", label=f"{attention} {layout}")
        save(fig, ax, "throughput.png")

    if rows:
        fig, ax = axes("Memory per GPU by ZeRO stage (closed form) and measured peaks", "GiB")
        ax.set_yscale("log")
        for stage in range(4):
            for (attention,), pts in _series(rows, f"mem_z{stage}_gib", ("attention",)).items():
                ax.plot(
                    *zip(*pts),
                    line_style(attention),
                    color=f"C{stage}",
                    label=f"ZeRO-{stage} {attention}",
                )
        for key, marker, label in (("train_rss_gib", "x", "measured RSS while training, rank 0"),
                                   ("peak_device_gib", "+", "measured GPU peak")):  # fmt: skip
            for (attention,), pts in _series(measured, key, ("attention",)).items():
                ax.plot(*zip(*pts), marker, color="k", label=f"{label} ({attention})")
        save(fig, ax, "memory.png")

    loss = _series(measured, "loss_last", ("attention", "layout"))
    if loss:
        fig, ax = axes("Loss after the measured steps", "MLM loss")
        for (attention, layout), pts in loss.items():
            ax.plot(*zip(*pts), line_style(attention), marker="o", label=f"{attention} {layout}")
        save(fig, ax, "loss.png")
    return written
