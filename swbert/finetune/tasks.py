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

    name: str
    """Our short name, also the Hub config name (``cola``, ``sst2``, ...)."""
    tsv_dir: str
    """Folder name inside a GLUE data directory (GLUE's ``download_glue_data.py`` layout)."""
    hub_text_columns: tuple[str, str | None]
    """First and second text column in the Hub dataset (``None``: single-sentence task)."""
    tsv_text_columns: tuple[str | int, str | int | None]
    """The same columns in the TSV files: header names, or 0-based indices for header-less files."""
    tsv_label_column: str | int
    """Label column in the TSV files (header name or 0-based index)."""
    label_names: tuple[str, ...]
    """Class names in index order; empty for regression (STS-B)."""
    tsv_label_values: tuple[str, ...]
    """How each class is spelled in the TSV files, in index order."""
    metrics: tuple[MetricName, ...]
    """Metrics GLUE reports for the task; their mean is the task score used for model selection."""
    dev_splits: dict[str, str] = field(default_factory=lambda: {"validation": "dev.tsv"})
    """Evaluation split name (as on the Hub) -> TSV file name."""
    tsv_has_header: bool = True
    """CoLA's train/dev files have no header row."""
    skip_malformed_rows: bool = False
    """QQP's train file has rows with missing fields; GLUE's loaders skip them, so do we (and say how many)."""

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

GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in [
        GlueTask(
            "cola",
            "CoLA",
            ("sentence", None),
            (3, None),
            1,
            ("unacceptable", "acceptable"),
            _BINARY,
            ("matthews",),
            tsv_has_header=False,
        ),
        GlueTask(
            "sst2",
            "SST-2",
            ("sentence", None),
            ("sentence", None),
            "label",
            ("negative", "positive"),
            _BINARY,
            ("accuracy",),
        ),
        GlueTask(
            "mrpc",
            "MRPC",
            ("sentence1", "sentence2"),
            ("#1 String", "#2 String"),
            "Quality",
            ("not_equivalent", "equivalent"),
            _BINARY,
            ("accuracy", "f1"),
        ),
        GlueTask(
            "stsb",
            "STS-B",
            ("sentence1", "sentence2"),
            ("sentence1", "sentence2"),
            "score",
            (),
            (),
            ("pearson", "spearman"),
        ),
        GlueTask(
            "qqp",
            "QQP",
            ("question1", "question2"),
            ("question1", "question2"),
            "is_duplicate",
            ("not_duplicate", "duplicate"),
            _BINARY,
            ("accuracy", "f1"),
            skip_malformed_rows=True,
        ),
        GlueTask(
            "mnli",
            "MNLI",
            ("premise", "hypothesis"),
            ("sentence1", "sentence2"),
            "gold_label",
            ("entailment", "neutral", "contradiction"),
            ("entailment", "neutral", "contradiction"),
            ("accuracy",),
            dev_splits={
                "validation_matched": "dev_matched.tsv",
                "validation_mismatched": "dev_mismatched.tsv",
            },
        ),
        GlueTask(
            "qnli",
            "QNLI",
            ("question", "sentence"),
            ("question", "sentence"),
            "label",
            _NLI2,
            _NLI2,
            ("accuracy",),
        ),
        GlueTask(
            "rte",
            "RTE",
            ("sentence1", "sentence2"),
            ("sentence1", "sentence2"),
            "label",
            _NLI2,
            _NLI2,
            ("accuracy",),
        ),
        # WNLI's TSV spells the classes 0/1 with 1 = entailment, the reverse of RTE/QNLI.
        GlueTask(
            "wnli",
            "WNLI",
            ("sentence1", "sentence2"),
            ("sentence1", "sentence2"),
            "label",
            ("not_entailment", "entailment"),
            _BINARY,
            ("accuracy",),
        ),
    ]
}

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
    "mnli": ("validation_matched", "accuracy"),
    "qqp": ("validation", "accuracy"),
    "qnli": ("validation", "accuracy"),
    "sst2": ("validation", "accuracy"),
    "cola": ("validation", "matthews"),
    "stsb": ("validation", "pearson"),
    "mrpc": ("validation", "accuracy"),
    "rte": ("validation", "accuracy"),
}

# Table 1's column order in the paper (arXiv 2412.00359v1): MRPC, CoLA, MNLI (m/mm), QQP, RTE, STS-B,
# QNLI, SST-2. MNLI contributes two splits (one "m/mm" cell in the report); WNLI, not in the paper,
# comes last when it was run.
TABLE1_COLUMNS: tuple[tuple[str, str], ...] = (
    ("mrpc", "validation"),
    ("cola", "validation"),
    ("mnli", "validation_matched"),
    ("mnli", "validation_mismatched"),
    ("qqp", "validation"),
    ("rte", "validation"),
    ("stsb", "validation"),
    ("qnli", "validation"),
    ("sst2", "validation"),
    ("wnli", "validation"),
)

# GLUE's own order (Wang et al., the benchmark's tables and leaderboard), the report's --column-order glue.
GLUE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("cola", "validation"),
    ("sst2", "validation"),
    ("mrpc", "validation"),
    ("stsb", "validation"),
    ("qqp", "validation"),
    ("mnli", "validation_matched"),
    ("mnli", "validation_mismatched"),
    ("qnli", "validation"),
    ("rte", "validation"),
    ("wnli", "validation"),
)
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
    if split == "validation_matched":
        return f"{base}-m"
    if split == "validation_mismatched":
        return f"{base}-mm"
    return base
