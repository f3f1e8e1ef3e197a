"""The data's held-out floors in a study: which points have not left the unigram floor (ours;
docs/scaling.md, "Floors")."""

from __future__ import annotations

from typing import Any

from swbert.data.floors import held_out_floors

__all__ = ["held_out_floors", "mark_floor"]


def mark_floor(rows: list[dict[str, Any]], floors: dict[str, float] | None, margin: float) -> list[str]:
    """Set each finished row's `below_unigram` (the unigram floor of its seed's masks, when `floors`
    has them by seed, minus its held-out loss) and
    `at_floor` (less than `margin` nats below it); return the names of the rows at the floor."""
    if floors is None:
        return []
    at = []
    for row in rows:
        loss = row.get("val_loss")
        floor = floors.get("by_seed", {}).get(str(row.get("seed")), floors)["unigram"]  # its own masks
        row["below_unigram"] = None if loss is None else floor - loss
        row["at_floor"] = row["status"] == "done" and loss is not None and row["below_unigram"] < margin
        if row["at_floor"]:
            at.append(row["name"])
    return at


def floor_lines(ax: Any, floors: dict[str, float] | None) -> None:
    """The unigram and bigram floors as labelled grey horizontal lines on a plot of held-out loss."""
    for name, style in (("unigram", ":"), ("bigram", "-.")):
        value = (floors or {}).get(name)
        if value is not None:
            ax.axhline(value, color="grey", linestyle=style, linewidth=1, label=f"{name} floor ({value:.2f})")
