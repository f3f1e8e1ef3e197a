"""GLUE task registry: columns, labels and metrics of each task, in one table.

Label indices follow the Hugging Face ``nyu-mll/glue`` ``ClassLabel`` order, so a model fine-tuned on the
Hub copy and one fine-tuned on GLUE's own TSV files agree on what logit ``i`` means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MetricName = Literal["accuracy", "f1", "matthews", "pearson", "spearman"]


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task and how to read it."""

    name: str  # our short name, also the Hub config name (cola, sst2, ...)
    tsv_dir: str  # folder in a GLUE data directory (GLUE's download_glue_data.py layout)
    hub_text_columns: tuple[str, str | None]  # first and second text column on the Hub (None: single)
    label_names: tuple[str, ...]  # class names in index order; empty for regression (STS-B)
    # metrics GLUE reports for the task; their mean is the score that selects the best checkpoint
    metrics: tuple[MetricName, ...] = ("accuracy",)
    # the text columns in the TSV files: header names, or 0-based indices for header-less files
    # (default: the Hub's names)
    tsv_text_columns: tuple[str | int, str | int | None] | None = None
    tsv_label_column: str | int = "label"  # label column in the TSV files (name or 0-based index)
    tsv_label_values: tuple[str, ...] | None = None  # each class as the TSVs spell it (default: its name)
    dev_splits: dict[str, str] = field(default_factory=lambda: {"validation": "dev.tsv"})  # Hub -> TSV
    tsv_has_header: bool = True  # CoLA's train/dev files have no header row
    # QQP's train file has rows with missing fields; GLUE's loaders skip them, so do we (and say how many)
    skip_malformed_rows: bool = False

    def __post_init__(self) -> None:
        if self.tsv_text_columns is None:
            object.__setattr__(self, "tsv_text_columns", self.hub_text_columns)
        if self.tsv_label_values is None:
            object.__setattr__(self, "tsv_label_values", self.label_names)

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)

    @property
    def is_pair(self) -> bool:
        return self.hub_text_columns[1] is not None

    @property
    def main_split(self) -> str:
        """The dev split used for best-checkpoint selection (MNLI: matched)."""
        return next(iter(self.dev_splits))


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_PAIR = ("sentence1", "sentence2")

GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in [
        GlueTask(
            "cola",
            "CoLA",
            ("sentence", None),
            ("unacceptable", "acceptable"),
            ("matthews",),
            (3, None),
            1,
            _BINARY,
            tsv_has_header=False,
        ),
        GlueTask("sst2", "SST-2", ("sentence", None), ("negative", "positive"), tsv_label_values=_BINARY),
        GlueTask(
            "mrpc",
            "MRPC",
            _PAIR,
            ("not_equivalent", "equivalent"),
            ("accuracy", "f1"),
            ("#1 String", "#2 String"),
            "Quality",
            _BINARY,
        ),
        GlueTask("stsb", "STS-B", _PAIR, (), ("pearson", "spearman"), tsv_label_column="score"),
        GlueTask(
            "qqp",
            "QQP",
            ("question1", "question2"),
            ("not_duplicate", "duplicate"),
            ("accuracy", "f1"),
            tsv_label_column="is_duplicate",
            tsv_label_values=_BINARY,
            skip_malformed_rows=True,
        ),
        GlueTask(
            "mnli",
            "MNLI",
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            tsv_text_columns=_PAIR,
            tsv_label_column="gold_label",
            dev_splits={
                "validation_matched": "dev_matched.tsv",
                "validation_mismatched": "dev_mismatched.tsv",
            },
        ),
        GlueTask("qnli", "QNLI", ("question", "sentence"), _NLI2),
        GlueTask("rte", "RTE", _PAIR, _NLI2),
        # WNLI's TSV spells the classes 0/1 with 1 = entailment, the reverse of RTE/QNLI.
        GlueTask("wnli", "WNLI", _PAIR, ("not_entailment", "entailment"), tsv_label_values=_BINARY),
    ]
}


def _columns(order: str) -> tuple[tuple[str, str], ...]:
    """(task, dev split) of the tasks in `order`, each task's dev splits in turn."""
    return tuple((t, split) for t in order.split() for split in GLUE_TASKS[t].dev_splits)


# The paper's GLUE benchmark: eight tasks (no WNLI). The GLUE launcher runs these by default; WNLI only
# when named in --tasks, and it never enters Table 1's average.
PAPER_GLUE_TASKS: tuple[str, ...] = ("mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte")

# Table 1's "Average" (arXiv 2412.00359v1, Table 1), one number per task of PAPER_GLUE_TASKS, the mean
# of the eight: MNLI with its matched dev set only (MNLI-mm is printed, not averaged), MRPC and QQP with
# accuracy (Table 1's caption), not F1 nor GLUE's mean of the two. This is our reading, pinned by the
# paper's own numbers: it gives standard's and shared's printed averages (tests/project/test_paper_numbers.py).
# STS-B: Table 1 prints one number where its caption says "Pearson/Spearman"; Pearson is our reading
# (the report's --stsb-metric changes it).
PAPER_AVG_METRIC: dict[str, tuple[str, MetricName]] = {
    t: (GLUE_TASKS[t].main_split, {"cola": "matthews", "stsb": "pearson"}.get(t, "accuracy"))  # type: ignore[misc]
    for t in PAPER_GLUE_TASKS
}

# Table 1's column order in the paper (arXiv 2412.00359v1): MRPC, CoLA, MNLI (m/mm), QQP, RTE, STS-B,
# QNLI, SST-2. MNLI contributes two splits (one "m/mm" cell in the report); WNLI, not in the paper,
# comes last when it was run.
TABLE1_COLUMNS = _columns("mrpc cola mnli qqp rte stsb qnli sst2 wnli")
# GLUE's own order (Wang et al., the benchmark's tables and leaderboard), the report's --column-order glue.
GLUE_COLUMNS = _columns("cola sst2 mrpc stsb qqp mnli qnli rte wnli")
COLUMN_ORDERS: dict[str, tuple[tuple[str, str], ...]] = {"paper": TABLE1_COLUMNS, "glue": GLUE_COLUMNS}

_ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli-m": "mnli", "mnli-mm": "mnli", "mnli_matched": "mnli"}


def get_task(name: str) -> GlueTask:
    """Look a task up by name, case-insensitively (``SST-2``, ``sst2`` and ``STS-B`` all work)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; choose from {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def split_label(task: GlueTask, split: str) -> str:
    """Short column label for a task's dev split: ``MNLI-m``, ``MNLI-mm``, ``SST-2`` ..."""
    base = {"cola": "CoLA", "sst2": "SST-2", "stsb": "STS-B"}.get(task.name, task.name.upper())
    return base + {"validation_matched": "-m", "validation_mismatched": "-mm"}.get(split, "")
