"""usage: python -m swbert.finetune.synthetic --output DIR [--key value ...]

Writes tiny synthetic tasks over a vocabulary of a few words for the fine-tuning launchers' offline
data flags, and prints those flags: a GLUE-style task (GLUE's TSV layout, under DIR/glue) and a
SQuAD-style one (SQuAD's JSON files, under DIR/squad), with the exact layouts of the real files (CoLA
without a header, MNLI with matched/mismatched dev files, SQuAD's nested JSON). Each task is decided by
one marker word, so a working pipeline beats chance by a wide margin within a few hundred steps of a
tiny model: for tests, smoke runs and the offline quick start (`make finetune`), which download
nothing. It checks that the pipeline runs and learns; it is not a benchmark, and its scores say
nothing about a model's quality."""

from __future__ import annotations

import csv
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from swbert import cli
from swbert.finetune.tasks import GlueTask, get_task

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
FILLER = "the a cat dog sat on mat ran to park big small red blue house tree car road sun day".split()
MARKERS = ["alpha", "beta", "gamma"]
SQUAD_WORDS = ["key", "where", "is", "what", "?", ".", ","]
VOCAB = SPECIALS + FILLER + MARKERS + SQUAD_WORDS


def _sentence(rng: random.Random, marker: str | None, length: int = 6) -> str:
    words = [rng.choice(FILLER) for _ in range(length)]
    if marker is not None:
        words.insert(rng.randrange(len(words) + 1), marker)
    return " ".join(words)


def _examples(task: GlueTask, n: int, rng: random.Random) -> list[tuple[str, str | None, str]]:
    """(text_a, text_b, label as the TSV spells it); the label is decided by a marker word."""
    out = []
    for _ in range(n):
        if task.is_regression:
            k = rng.randrange(4)  # the score grows with the number of "alpha"s
            a = " ".join([_sentence(rng, None, 3)] + ["alpha"] * k)
            out.append((a, _sentence(rng, None), f"{k * 5 / 3:.3f}"))
            continue
        y = rng.randrange(task.num_labels)
        if task.is_pair:
            out.append((_sentence(rng, None), _sentence(rng, MARKERS[y]), task.tsv_label_values[y]))
        else:
            out.append((_sentence(rng, MARKERS[y]), None, task.tsv_label_values[y]))
    return out


def _write_tsv(task: GlueTask, path: Path, rows: list[tuple[str, str | None, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar=None, lineterminator="\n")
        if not task.tsv_has_header:
            # CoLA: source, label, original label ('*' when unacceptable), sentence; no header row.
            for a, _, y in rows:
                w.writerow(["gj04", y, "" if y == "1" else "*", a])
            return
        # A realistic header: the columns we read plus a leading index column GLUE files also have.
        w.writerow(["index", *task.tsv_text_columns[: 2 if task.is_pair else 1], task.tsv_label_column])
        for i, (a, b, y) in enumerate(rows):
            w.writerow([str(i), a, *([b] if task.is_pair else []), y])


def write_glue_fixture(
    root: str | Path, tasks: list[str], n_train: int = 256, n_dev: int = 64, seed: int = 0
) -> Path:
    """Write ``tasks`` (e.g. ``["sst2", "mnli"]``) under ``root`` in GLUE's folder and file layout."""
    root = Path(root)
    rng = random.Random(seed)
    for name in tasks:
        task = get_task(name)
        _write_tsv(task, root / task.tsv_dir / "train.tsv", _examples(task, n_train, rng))
        for file in task.dev_splits.values():
            _write_tsv(task, root / task.tsv_dir / file, _examples(task, n_dev, rng))
    return root


def write_squad_fixture(
    path: str | Path, n: int = 64, version: str = "1.1", seed: int = 0, context_words: int = 40
) -> Path:
    """A SQuAD-format JSON file: "where is key ?" is answered by the marker word after "key".

    For v2.0 every fourth question has no "key" in its context and is marked ``is_impossible``.
    Contexts of ``context_words`` words are longer than small windows, so doc-stride windows are used.
    """
    rng = random.Random(seed)
    articles = []
    for i in range(n):
        words = [rng.choice(FILLER) for _ in range(context_words)]
        qa: dict = {"id": f"q{i}", "question": "where is key ?", "answers": []}
        if version == "2.0":
            qa["is_impossible"] = i % 4 == 3
        if not qa.get("is_impossible"):
            pos, target = rng.randrange(context_words - 1), rng.choice(MARKERS)
            words[pos : pos + 2] = ["key", target]
            qa["answers"] = [{"text": target, "answer_start": len(" ".join(words[: pos + 1])) + 1}]
        articles.append({"title": f"article {i}", "paragraphs": [{"context": " ".join(words), "qas": [qa]}]})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": f"v{version}", "data": articles}), encoding="utf-8")
    return path


@dataclass
class SyntheticData:
    """The flags of ``python -m swbert.finetune.synthetic``: what to write, and where."""

    output: Path  # folder to write: glue/ (GLUE's TSV layout) and squad/ (SQuAD's JSON files)
    # GLUE tasks to imitate (each in its real file layout, e.g. mnli with matched/mismatched dev files)
    glue_tasks: list[str] = field(default_factory=lambda: ["sst2"])
    # SQuAD versions to write, each its own train and dev file (2.0 adds unanswerable questions)
    squad_versions: list[Literal["1.1", "2.0"]] = field(default_factory=lambda: ["1.1"])
    train_examples: int = 256  # training examples per task
    dev_examples: int = 64  # dev examples per task (and per dev split: MNLI has two)
    seed: int = 0  # the examples' random draw

    def check(self) -> None:
        for name in ("train_examples", "dev_examples"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in self.glue_tasks:
            get_task(name)
        if self.output.exists() and not self.output.is_dir():
            raise ValueError(f"--output {self.output} is a file: name a folder")


def write_quickstart(cfg: SyntheticData) -> list[str]:
    """Write the tasks ``cfg`` asks for; return one line per task naming the launcher flags that read
    it (what a user passes next, so the printed flags and the files cannot drift apart)."""
    glue = cfg.output / "glue"
    names = [get_task(t).name for t in cfg.glue_tasks]
    write_glue_fixture(glue, names, cfg.train_examples, cfg.dev_examples, cfg.seed)
    lines = [
        f"GLUE-style ({' '.join(names)}): launchers/finetune_glue.py --data-dir {glue} --tasks {' '.join(names)}"
    ]
    for v in cfg.squad_versions:
        train = write_squad_fixture(
            cfg.output / "squad" / f"train-v{v}.json", cfg.train_examples, v, cfg.seed
        )
        dev = write_squad_fixture(cfg.output / "squad" / f"dev-v{v}.json", cfg.dev_examples, v, cfg.seed + 1)
        lines.append(
            f"SQuAD-style (v{v}): launchers/finetune_squad.py --versions {v} "
            f"--train-file {v}={train} --dev-file {v}={dev}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 written; 2 bad input (a flag), with a one-line error."""
    cfg = cli.parse_or_exit(SyntheticData, argv, __doc__, recipes=False)
    for line in cli.exit_on_bad_input(lambda: write_quickstart(cfg)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
