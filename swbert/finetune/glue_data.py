"""Reading GLUE splits (GLUE's own TSV files or the Hub's ``nyu-mll/glue``) and encoding them.

GLUE's TSV files have quirks that matter: CoLA's train/dev files have no header, MNLI has
``dev_matched.tsv`` and ``dev_mismatched.tsv``, quotes are literal characters (so ``csv.QUOTE_NONE``),
and QQP's train file has malformed rows that GLUE's loaders skip. Anything else that is wrong (a missing
column, a label outside the task's label set, an empty split) is an error naming the file and row.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swbert.finetune.tasks import GlueTask

log = logging.getLogger(__name__)

HUB_DATASET = "nyu-mll/glue"


class GlueDataError(ValueError):
    """A GLUE file (or Hub split) that cannot be used as it is."""


@dataclass
class GlueExamples:
    """One split of one task, as plain columns."""

    task: GlueTask
    split: str
    source: str  # file path or Hub id, for messages
    text_a: list[str]
    text_b: list[str] | None
    labels: np.ndarray  # int64 class indices, or float32 scores for STS-B

    def __len__(self) -> int:
        return len(self.text_a)

    def head(self, n: int | None) -> GlueExamples:
        """The first ``n`` examples (all when ``n`` is None): for quick runs."""
        text_b = None if self.text_b is None else self.text_b[:n]
        return dataclasses.replace(self, text_a=self.text_a[:n], text_b=text_b, labels=self.labels[:n])


def split_file(task: GlueTask, split: str) -> str:
    """TSV file name of ``split`` (``train`` or one of the task's dev splits)."""
    files = {"train": "train.tsv", **task.dev_splits}
    if split not in files:
        raise GlueDataError(f"{task.name} has no split {split!r}; it has {', '.join(files)}")
    return files[split]


def load_glue_split(task: GlueTask, split: str, data_dir: str | Path | None = None) -> GlueExamples:
    """Load ``split`` of ``task`` from ``data_dir`` (GLUE's TSV layout) or, when None, from the Hub."""
    if data_dir is None:
        return read_glue_hub(task, split)
    path = Path(data_dir) / task.tsv_dir / split_file(task, split)
    if not path.is_file():
        raise GlueDataError(
            f"{path} not found: --data-dir must hold GLUE's layout, e.g. {task.tsv_dir}/train.tsv and "
            f"{task.tsv_dir}/{next(iter(task.dev_splits.values()))} (or leave --data-dir out to use the Hub)"
        )
    return read_glue_tsv(task, path, split)


def read_glue_tsv(task: GlueTask, path: str | Path, split: str) -> GlueExamples:
    """Parse one GLUE TSV file, checking columns and labels row by row."""
    path = Path(path)
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # some MNLI parse columns are long
    # utf-8-sig: MRPC's files as distributed start with a byte-order mark before "Quality".
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1))
    columns = [*task.tsv_text_columns, task.tsv_label_column]
    ia, ib, il = _column_index(task, path, rows, columns)
    needed = max(i for i in (ia, ib, il) if i is not None) + 1
    text_a, labels, skipped = [], [], []
    text_b: list[str] | None = None if ib is None else []
    for line, row in rows:
        if not row or row == [""]:
            continue  # a trailing blank line
        if len(row) < needed and task.skip_malformed_rows:
            skipped.append(line)
            continue
        if len(row) < needed:
            raise GlueDataError(
                f"{path}, line {line}: {len(row)} fields, expected at least {needed} (a missing column?)"
            )
        labels.append(_parse_label(task, row[il], f"{path}, line {line}"))
        text_a.append(_text(row[ia], f"{path}, line {line}: example {len(labels) - 1}", columns[0]))
        if text_b is not None:
            text_b.append(row[ib])
    if skipped:
        lines = ", ".join(map(str, skipped[:5])) + (" ..." if len(skipped) > 5 else "")
        log.warning(
            "%s: skipped %d malformed rows (lines %s), as GLUE's loaders do", path, len(skipped), lines
        )
    if not labels:
        raise GlueDataError(f"{path}: the {split} split has no examples")
    dtype = np.float32 if task.is_regression else np.int64
    return GlueExamples(task, split, str(path), text_a, text_b, np.asarray(labels, dtype=dtype))


def _column_index(task: GlueTask, path: Path, rows: list, columns: list) -> list[int | None]:
    """Where `columns` are in each row: by the header row (taken off `rows`), or as given (no header)."""
    if not task.tsv_has_header:
        return columns
    if not rows:
        raise GlueDataError(f"{path}: the file is empty; expected a header row and examples")
    header = rows.pop(0)[1]
    missing = [c for c in columns if c is not None and c not in header]
    if missing:
        raise GlueDataError(
            f"{path}, line 1: header has no column {', '.join(map(repr, missing))} (found {header}); "
            f"is this the {task.tsv_dir} file of GLUE?"
        )
    return [None if c is None else header.index(c) for c in columns]


def check_fits(data: EncodedDataset, positions: int, source: str) -> EncodedDataset:
    """`data`, checked before any training: every example fits the model's `positions`."""
    for index, ids in enumerate(data.features["input_ids"]):
        if len(ids) > positions:
            raise GlueDataError(
                f"{source}: example {index} has {len(ids)} tokens, more than the model's {positions} "
                f"positions; pass --max-seq-length {positions} or less (longer examples are truncated)"
            )
    return data


def _text(text: str, where: str, column: str | int) -> str:
    """An example's (first) text; empty, a one-line error: there is nothing to classify."""
    if not text.strip():
        raise GlueDataError(f"{where}'s text (column {column!r}) is empty; fill it or remove the row")
    return text


def _parse_label(task: GlueTask, raw: str, where: str) -> float:
    raw = raw.strip()
    if not task.is_regression:
        if raw not in task.tsv_label_values:
            raise GlueDataError(
                f"{where}: label {raw!r} is not one of {task.name}'s labels {list(task.tsv_label_values)}"
            )
        return task.tsv_label_values.index(raw)
    try:
        value = float(raw)
    except ValueError:
        raise GlueDataError(
            f"{where}: label {raw!r} is not a number ({task.name} is a regression task)"
        ) from None
    if not 0.0 <= value <= 5.0:  # STS-B's similarity scale
        raise GlueDataError(f"{where}: score {value} is outside {task.name}'s range [0.0, 5.0]")
    return value


def hub_split(
    source: str, dataset: tuple[str, str | None, str], error: type[ValueError], offline: str
) -> Any:
    """A Hub dataset's split (`dataset`: name, config, split); a failure is one `error` line naming
    `source` and what to pass `offline`."""
    from swbert.finetune.hub import load_hub_dataset

    try:
        return load_hub_dataset(*dataset)
    except Exception as e:  # datasets raises many types: offline, missing config, network
        raise error(f"could not load {source} ({' '.join(str(e).split())}); offline, {offline}") from e


def read_glue_hub(task: GlueTask, split: str) -> GlueExamples:
    """A split of ``nyu-mll/glue`` (from the Hub, else from the local ``datasets`` cache)."""
    source, dev = f"{HUB_DATASET}/{task.name}:{split}", next(iter(task.dev_splits.values()))
    offline = f"pass --data-dir DIR with GLUE's TSV files ({task.tsv_dir}/train.tsv, {task.tsv_dir}/{dev}, ...; docs/finetuning.md)"
    ds = hub_split(source, (HUB_DATASET, task.name, split), GlueDataError, offline)
    a, b = task.hub_text_columns
    missing = [c for c in (a, b, "label") if c is not None and c not in ds.column_names]
    if missing:
        raise GlueDataError(f"{source}: no column {missing} (found {ds.column_names})")
    labels = np.asarray(ds["label"], dtype=np.float32 if task.is_regression else np.int64)
    if len(labels) == 0:
        raise GlueDataError(f"{source}: the split has no examples")
    if not task.is_regression:
        bad = np.flatnonzero((labels < 0) | (labels >= task.num_labels))
        if bad.size:
            raise GlueDataError(
                f"{source}, row {int(bad[0])}: label {int(labels[bad[0]])} outside 0..{task.num_labels - 1} "
                "(test splits have no labels; fine-tune and evaluate on train/validation)"
            )
    text_a = [_text(t or "", f"{source}: example {i}", a) for i, t in enumerate(ds[a])]
    text_b = None if b is None else [t or "" for t in ds[b]]  # a missing second text: empty, as in a TSV
    return GlueExamples(task, split, source, text_a, text_b, labels)


# ------------------------------------------------------------------------------------------- encoding


class EncodedDataset(torch.utils.data.Dataset):
    """Tokenised examples of variable length; :func:`pad_collate` pads each batch to its longest."""

    def __init__(self, features: dict[str, list], labels: dict[str, np.ndarray] | None = None):
        self.features, self.labels = features, labels or {}

    def __len__(self) -> int:
        return len(next(iter(self.features.values())))

    def __getitem__(self, i: int) -> dict:
        item = {k: v[i] for k, v in self.features.items()}
        item.update({k: v[i] for k, v in self.labels.items()})
        return item


def pad_collate(pad_token_id: int, bucket: int = 1, longest: int | None = None):
    """A ``collate_fn`` padding ``input_ids`` with ``pad_token_id`` and the rest with 0.

    A batch without padding gets no ``attention_mask``: known on the host, it spares the model a mask
    (GPUs keep their flash kernel) without a device read. With ``bucket`` > 1 (compiled runs) a batch
    is padded up to a multiple of ``bucket`` tokens (at most ``longest``): one shape per bucket."""

    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(it["input_ids"]) for it in items)
        if bucket > 1:
            length = max(length, min(-(-length // bucket) * bucket, longest or length))
        padded = bucket > 1 or any(
            len(it["input_ids"]) != length or not all(it.get("attention_mask", [1])) for it in items
        )
        out: dict[str, torch.Tensor] = {}
        for key, value in items[0].items():
            if key == "attention_mask" and not padded:
                continue
            if isinstance(value, list):
                pad = pad_token_id if key == "input_ids" else 0
                out[key] = torch.tensor(
                    [it[key] + [pad] * (length - len(it[key])) for it in items], dtype=torch.long
                )
            else:
                out[key] = torch.as_tensor(np.asarray([it[key] for it in items]))
        return out

    return collate


def encode_glue(
    examples: GlueExamples, tokenizer, max_length: int, use_token_type_ids: bool = True
) -> EncodedDataset:
    """Tokenise a split as ``[CLS] a [SEP] (b [SEP])``, truncated to ``max_length`` tokens."""
    enc = tokenizer(
        examples.text_a,
        examples.text_b,
        truncation=True,
        max_length=max_length,
        return_attention_mask=True,
        return_token_type_ids=use_token_type_ids,
    )
    return EncodedDataset(model_inputs(enc, use_token_type_ids), {"labels": examples.labels})


def model_inputs(enc, use_token_type_ids: bool) -> dict[str, list]:
    """The tokenizer's output the model takes: ids, mask, and token types where the model has them."""
    keys = ["input_ids", "attention_mask", *(["token_type_ids"] if use_token_type_ids else [])]
    return {k: enc[k] for k in keys if k in enc}
