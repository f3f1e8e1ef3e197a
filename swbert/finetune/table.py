"""What the report's tables and figures share: a table (markdown and CSV), a trial's timing, the
paper's row order of the variants and the metric Table 5 reports (`swbert.finetune.report` makes
the tables, `swbert.finetune.figures` the figures)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from swbert.finetune.tasks import GlueTask

VARIANT_ORDER = ("standard", "symmetric", "pairwise", "shared")  # the paper's row order
TRIVIAQA_SUFFIX = "+triviaqa"  # a variant fine-tuned on TriviaQA before SQuAD (swbert.finetune.squad)


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
        lines = [f"### {self.title}", "", "| " + " | ".join(self.header) + " |"]
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(self.header) - 1)) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path, stem: str) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        md, cs = out_dir / f"{stem}.md", out_dir / f"{stem}.csv"
        md.write_text(self.markdown(), encoding="utf-8")
        with open(cs, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(self.csv_header)
            w.writerows(self.csv_rows)
        return [md, cs]


@dataclass
class Timing:
    """One trial's training time (Figure 3)."""

    variant: str
    task: str
    batch_size: int
    seconds_per_epoch: float
    attention_type: str = ""
    batching: str = "padded"  # the trial's `batching` param (--unpad); runs from before it padded


def variant_key(name: str) -> tuple[int, str, str]:
    """The paper's row order; ``NAME+triviaqa`` right after ``NAME``."""
    base, _, suffix = name.partition("+")
    return (VARIANT_ORDER.index(base) if base in VARIANT_ORDER else len(VARIANT_ORDER), base, suffix)


def variant_label(name: str) -> str:
    """``shared+triviaqa`` -> ``shared + TriviaQA`` (Table 2's "single + TriviaQA" rows)."""
    return name[: -len(TRIVIAQA_SUFFIX)] + " + TriviaQA" if name.endswith(TRIVIAQA_SUFFIX) else name


def noise_metric(task: GlueTask) -> str:
    """What Table 5 reports for ``task``: accuracy, or the task's own metric where it has none."""
    return "accuracy" if "accuracy" in task.metrics else task.metrics[0]
