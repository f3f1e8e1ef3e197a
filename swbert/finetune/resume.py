"""A fine-tuning sweep run again continues where it stopped.

Each finished trial leaves a record under `<output-dir>/trials/` (written last, atomically, after
its model is saved): its hyper-parameters, the checkpoint it started from (path, file sizes and
times), its MLflow run and best metrics. A re-run of the sweep finds the record, skips the
training and logs the recorded result as a child of the new sweep run (tagged with the run it
came from), so the report of the new run is complete. Any change of a trial's flags or of its
checkpoint makes the record not match, and the trial runs again.

A killed sweep leaves its MLflow runs RUNNING for ever; `<output-dir>/sweep_run.json` names the
sweep's run, so the next sweep in that folder marks it and its running children KILLED.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from swbert.finetune.results import Trial
from swbert.finetune.tracking import Tracker

log = logging.getLogger("swbert.finetune")

RECORD_FORMAT = "swbert-trial/1"
SWEEP_RUN_NAME = "sweep_run.json"
REUSED_FROM = "swbert.reused_from"


def record_path(output_dir: Path, variant: str, task: str, folder: str) -> Path:
    """Where one trial's record lives: beside, not inside, its model folder (pruning removes those)."""
    return Path(output_dir) / "trials" / variant / task / f"{folder}.json"


def checkpoint_fingerprint(folder: Path) -> list[list[Any]]:
    """(name, size, mtime_ns) of the checkpoint's top-level files: a re-exported checkpoint differs."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file()) if Path(folder).is_dir() else []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


# Sweep flags that choose which trials run, where results go or what is evaluated after training;
# every other flag (data files, sequence length, ... and any flag added later) is part of a trial's key.
NOT_IN_TRIAL_KEY = frozenset(
    "checkpoint learning_rates seeds tasks versions output_dir tracking_uri experiment run_name keep "
    "noise noise_levels noise_seeds noise_scales cross_domain evaluate_finetuned plugins".split()
)


def trial_key(
    params: dict[str, Any], tags: dict[str, str], checkpoint: Path, sweep_params: dict[str, str]
) -> dict[str, Any]:
    """What must be equal for a recorded result to stand for this trial (JSON-comparable)."""
    return {
        "params": {key: str(value) for key, value in sorted(params.items())},
        "tags": dict(sorted(tags.items())),
        "checkpoint": checkpoint_fingerprint(checkpoint),
        "sweep": {k: v for k, v in sorted(sweep_params.items()) if k not in NOT_IN_TRIAL_KEY},
    }


def _write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as stream:
        json.dump(payload, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def save_finished(
    path: Path, key: dict[str, Any], trial: Trial, run_id: str | None, metrics: dict[str, float]
) -> None:
    """Record a finished trial (rank 0, after its model is saved: the record says it is complete)."""
    payload = {
        "format": RECORD_FORMAT,
        "key": key,
        "run_id": run_id,
        "metrics": metrics,
        "trial": {
            "variant": trial.variant,
            "task": trial.task,
            "learning_rate": trial.learning_rate,
            "seed": trial.seed,
            "metrics": trial.metrics,
            "model_dir": trial.model_dir,
            "later_lrs": list(trial.later_lrs),
        },
    }
    _write_json_atomic(path, payload)


def load_finished(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The record of this very trial (same flags, same checkpoint files), or None: run it."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or record.get("key") != key:
        return None
    return record


def trial_from_record(record: dict[str, Any]) -> Trial:
    """The recorded `Trial`; a model removed since (`--keep median` pruned it) reads as not kept."""
    t = record["trial"]
    model_dir = t["model_dir"] if t["model_dir"] and Path(t["model_dir"]).is_dir() else ""
    later = tuple(t["later_lrs"])
    return Trial(t["variant"], t["task"], t["learning_rate"], t["seed"], t["metrics"], model_dir, later)


def log_reused(tracker: Tracker, name: str, tags: dict[str, str], params: dict, record: dict) -> None:
    """The recorded result as a FINISHED child of this sweep's run, tagged with the run it came from."""
    with tracker.run(name, {**tags, REUSED_FROM: str(record.get("run_id"))}, params) as run_id:
        tracker.log(run_id, record["metrics"])


def mark_killed_sweep(tracker: Tracker, output_dir: Path) -> list[str]:
    """Mark the sweep run named in `output_dir/sweep_run.json`, and its children, KILLED where they
    are still RUNNING (their sweep was killed: nothing else ends them). Returns the runs marked."""
    if not tracker.enabled:
        return []
    try:
        previous = json.loads((Path(output_dir) / SWEEP_RUN_NAME).read_text(encoding="utf-8"))["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    marked = tracker.kill_running(previous)
    if marked:
        log.info("marked %d run(s) of the killed sweep %s as KILLED", len(marked), previous)
    return marked


def remember_sweep(tracker: Tracker, output_dir: Path, run_id: str | None) -> None:
    """Name this sweep's MLflow run in `output_dir`, for the next sweep there (rank 0)."""
    if tracker.enabled and run_id is not None:
        _write_json_atomic(Path(output_dir) / SWEEP_RUN_NAME, {"run_id": run_id, "tracking_uri": tracker.uri})
