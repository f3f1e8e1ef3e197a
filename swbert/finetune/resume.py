"""A fine-tuning sweep run again continues where it stopped.

Each finished trial leaves a record under `<output-dir>/trials/` (written last, atomically, after
its model is saved): its hyper-parameters, the checkpoint it started from (path, file sizes and
times), its MLflow run and best metrics. A re-run of the sweep finds the record, skips the
training and logs the recorded result as a child of the new sweep run (tagged with the run it
came from), so the report of the new run is complete. Any change of a trial's flags or of its
checkpoint makes the record not match, and the trial runs again.

A killed sweep leaves its MLflow runs RUNNING for ever; `<output-dir>/sweep_run.json` names the
sweep's run, so the next sweep in that folder marks it and its running children KILLED
(`swbert.studies.tracking.Tracker.sweep`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from swbert.finetune.results import Trial
from swbert.studies.records import Records
from swbert.studies.tracking import REUSED_FROM, Tracker

log = logging.getLogger("swbert.finetune")


def trial_records(output_dir: Path) -> Records:
    """Trial records, `<output-dir>/trials/<variant>/<task>/<folder>.json`: beside, not inside, the
    model folders (pruning removes those)."""
    return Records(Path(output_dir) / "trials", "swbert-trial/1")


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


def trial_payload(trial: Trial, run_id: str | None, metrics: dict[str, float]) -> dict[str, Any]:
    """What a finished trial's record holds besides its key: its MLflow run and best metrics."""
    fields = ("variant", "task", "learning_rate", "seed", "metrics", "model_dir")
    t = {name: getattr(trial, name) for name in fields}
    return {"run_id": run_id, "metrics": metrics, "trial": {**t, "later_lrs": list(trial.later_lrs)}}


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
