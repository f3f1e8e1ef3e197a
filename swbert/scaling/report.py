"""The studies' plots: the systems study's throughput, memory and loss against size, shared vs
standard, and what every study plot shares (log x, one line style per variant, the data's floors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swbert.models.attention import attention_types
from swbert.studies.outputs import new_axes, save_figure

# Line styles given to the attention variants in registration order (standard dashed, shared solid,
# symmetric dotted, pairwise dash-dot), cycling for any registered after them.
LINE_STYLES = ("--", "-", ":", "-.")


def line_style(attention: str) -> str:
    """The variant's line style; solid for a name not registered in this process (an old CSV's)."""
    names = attention_types()
    return LINE_STYLES[names.index(attention) % len(LINE_STYLES)] if attention in names else "-"


def floor_lines(ax: Any, floors: dict[str, float] | None) -> None:
    """The unigram and bigram floors as labelled grey horizontal lines on a plot of held-out loss."""
    for name, style in (("unigram", ":"), ("bigram", "-.")):
        value = (floors or {}).get(name)
        if value is not None:
            ax.axhline(value, color="grey", linestyle=style, linewidth=1, label=f"{name} floor ({value:.2f})")


def save_plot(fig: Any, ax: Any, path: Path, fontsize: int = 7) -> Path:
    """x made logarithmic (after drawing: a log axis set before a lone point gives matplotlib a zero
    width) and the figure written (`save_figure`)."""
    ax.set_xscale("log")
    return save_figure(fig, path, dpi=120, legend_size=fontsize)


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
    """throughput.png, loss.png, memory.png (only those with data); returns the files written."""
    written = []
    measured = [r for r in rows if r.get("status") == "measured"]
    for key, stem, title, ylabel in (
        ("tokens_per_s", "throughput", "Measured training throughput", "tokens / s"),
        ("loss_last", "loss", "Loss after the measured steps", "MLM loss"),
    ):
        series = _series(measured, key, ("attention", "layout"))
        if series:
            fig, ax = new_axes(title, "parameters", ylabel)
            ax.set_yscale("log" if stem == "throughput" else "linear")
            for (attention, layout), pts in series.items():
                ax.plot(*zip(*pts), line_style(attention), marker="o", label=f"{attention} {layout}")
            written.append(save_plot(fig, ax, folder / f"{stem}.png"))
    if not rows:
        return written
    fig, ax = new_axes("Memory per GPU by ZeRO stage (closed form) and measured peaks", "parameters", "GiB")
    ax.set_yscale("log")
    for stage in range(4):
        for (attention,), pts in _series(rows, f"mem_z{stage}_gib", ("attention",)).items():
            ax.plot(*zip(*pts), line_style(attention), color=f"C{stage}", label=f"ZeRO-{stage} {attention}")
    for key, marker, label in (("train_rss_gib", "x", "measured RSS while training, rank 0"),
                               ("peak_device_gib", "+", "measured GPU peak")):  # fmt: skip
        for (attention,), pts in _series(measured, key, ("attention",)).items():
            ax.plot(*zip(*pts), marker, color="k", label=f"{label} ({attention})")
    return [*written, save_plot(fig, ax, folder / "memory.png")]
