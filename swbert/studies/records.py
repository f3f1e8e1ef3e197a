"""What a study keeps on disk: one record per finished point (written last, atomically; it stands
for its key, the options and data the point was made with), and in `study.json` the options and data
the study was run with: a re-run with others is refused naming what differs, unless
`--allow-study-change` (docs/scaling.md, "Long studies are safe")."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from swbert.data import manifest

log = logging.getLogger("swbert.studies")

STUDY_FILE = "study.json"
DATA = "data"  # the key of a study's data identity in its options (`data_identity`)


def write_json_atomic(path: Path, payload: Any) -> None:
    """`payload` as JSON at `path`, its folder made, whole or not at all (`swbert.data.manifest`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_json_atomic(path, jsonable(payload))


def read_json(path: Path) -> Any | None:
    """The JSON at `path`, or None when it is missing or torn."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class Records:
    """A study's point records, `folder/<pattern>`: JSON with the format, the key it stands for (None:
    any) and the study's payload."""

    def __init__(self, folder: Path, fmt: str, pattern: str = "{name}.json") -> None:
        self.folder, self.fmt, self.pattern = Path(folder), fmt, pattern

    def path(self, name: str) -> Path:
        return self.folder / self.pattern.format(name=name)

    def load(self, name: str, key: Any = None) -> dict[str, Any] | None:
        """The record of point `name` made for `key` (any key when None), or None: run the point."""
        record = read_json(self.path(name))
        if not isinstance(record, dict) or record.get("format") != self.fmt:
            return None
        made_for = record.get("key")  # None: any (a study's record from before keys were kept)
        if key is not None and made_for is not None and made_for != jsonable(key):
            return None
        return record

    def save(self, name: str, payload: dict[str, Any], key: Any = None) -> Path:
        """Record point `name` as finished (call last, once what it made is complete)."""
        path = self.path(name)
        write_json_atomic(path, {**payload, "format": self.fmt, "key": key})
        return path

    def any(self) -> bool:
        return any(p.is_file() for p in self.folder.rglob(Path(self.pattern).name.format(name="*")))

    def set_aside(self, name: str) -> Path:
        """Move point `name`'s record aside (with the point's own folder, if any): kept, never read."""
        old = self.path(name).parent if self.pattern.startswith("{name}/") else self.path(name)
        aside = old.with_name(f"{old.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(old, aside)
        return aside


def point_records(folder: Path, kind: str) -> Records:
    """The records of a pretraining study's points (`kind`: scaling, quality): points/NAME/point.json."""
    return Records(Path(folder) / "points", f"swbert-{kind}-point/1", "{name}/point.json")


def jsonable(value: Any) -> Any:
    """`value` as it reads back from JSON (paths as strings, tuples as lists)."""
    return json.loads(json.dumps(value, default=str))


def data_identity(files: Iterable[str | Path]) -> dict[str, str]:
    """{path: sha256} of the files a study's points read (a shard folder's manifest.json, which holds
    every shard's hash; a fine-tuning task's files)."""
    return {str(Path(f).resolve()): manifest.file_sha256(f) for f in dict.fromkeys(files)}


def spelled(value: Any) -> str:
    """A value as a command line (and an MLflow param) spells it: a list's items joined by spaces."""
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def check_study(
    folder: Path, kind: str, spec: dict[str, Any], allow_change: bool = False, records: Records | None = None
) -> None:
    """Keep `spec` (the options that decide the points) in folder/study.json; a ValueError naming what
    differs from the `kind` study there, unless `allow_change` or no point has a record in `records`
    yet (a run stopped by bad input made nothing to relabel)."""
    spec = jsonable(spec)
    path = Path(folder) / STUDY_FILE
    saved = read_json(path)
    before = saved.get("options") if isinstance(saved, dict) and saved.get("study") == kind else None
    if isinstance(before, dict) and DATA in spec and DATA not in before:  # kept before data was: unknown
        before[DATA] = spec.get(DATA)
    if isinstance(before, dict) and before != spec:
        changes = []  # `--flag NOW (was BEFORE)` for every option that differs, in the order of `spec`
        for key in dict.fromkeys([*spec, *before]):
            if key == DATA and before.get(key) != spec.get(key):
                was, files = before.get(key) or {}, spec.get(key) or {}
                changed = [f for f in dict.fromkeys([*files, *was]) if was.get(f) != files.get(f)]
                changes.append(
                    f"the data changed: {', '.join(changed)} (sha256 differs, or files added or gone)"
                )
            elif before.get(key) != spec.get(key):
                now, old = spelled(spec.get(key, "(unset)")), spelled(before.get(key, "(unset)"))
                changes.append(f"--{key.replace('_', '-')} {now} (was {old})")
        if not allow_change and (records is None or records.any()):
            raise ValueError(
                f"{folder} holds a {kind} study run with other options: {'; '.join(changes)}; use "
                "another --output-dir, the same options and data, or --allow-study-change (the changed "
                "points run again; finished ones are kept, never relabelled)"
            )
        log.info("%s: the study's options changed (--allow-study-change): %s", folder, "; ".join(changes))
    if saved != {"study": kind, "options": spec}:  # array tasks check at once: only a change writes
        write_json_atomic(path, {"study": kind, "options": spec})


# Options of every study that choose where results go or how it is run, not what its points are
NOT_OPTIONS = ("output_dir", "tracking_uri", "experiment", "plugins", "allow_study_change", "retry_failed",
               "allow_tokenizer_change", "emit_slurm", "gpus_per_node", "collect", "point_timeout_s")  # fmt: skip


def study_options(config: Any, left_out: Iterable[str], data: dict[str, str] | None = None) -> dict[str, Any]:
    """A study config's fields, less `NOT_OPTIONS` and `left_out`, and its `data`'s identity."""
    skip = {*NOT_OPTIONS, *left_out}
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in skip}
    return jsonable({**options, DATA: data or {}})


def point_key(options: dict[str, Any], chooses: Iterable[str], **point: Any) -> dict[str, Any]:
    """What a point's record stands for: the study's options less those that only choose which points
    there are (a new size or seed leaves the others' keys alone), and the point's own facts."""
    skip = set(chooses)
    return jsonable({"options": {k: v for k, v in options.items() if k not in skip}, **point})
