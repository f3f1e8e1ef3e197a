"""The report command: MLflow runs -> the paper's table layouts (markdown, CSV) and the noise plot."""

from __future__ import annotations

import csv
import runpy
from pathlib import Path

import pytest

from swbert.finetune.report import collect
from swbert.finetune.tracking import CHECKPOINT, KIND, TASK, VARIANT, Tracker, tracking_uri

ROOT = Path(__file__).resolve().parents[1]


def report_main(argv: list[str]) -> int:
    return runpy.run_path(str(ROOT / "launchers" / "report.py"), run_name="launcher")["main"](argv)


def trial(
    tracker: Tracker,
    variant: str,
    task: str,
    lr: float,
    seed: int,
    metrics: dict[str, float],
    kind: str = "glue_trial",
):
    tags = {KIND: kind, VARIANT: variant, TASK: task, CHECKPOINT: f"/ckpt/{variant}"}
    with tracker.run(f"{variant}/{task}/{lr}/{seed}", tags, {"learning_rate": lr, "seed": seed}) as rid:
        tracker.log(rid, {f"best/{k}": v for k, v in metrics.items()})


def mrpc(acc: float, f1: float) -> dict[str, float]:
    return {"validation/accuracy": acc, "validation/f1": f1, "validation/score": (acc + f1) / 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    tracker = Tracker(tracking_uri(root))
    with tracker.sweep("first", "glue_sweep") as first:
        # standard/MRPC: lr 1e-4 scores .83 .85 .87 (median .85); lr 2e-5 scores .75 .91 .88 (median .88) wins
        for seed, (a, f) in enumerate([(0.80, 0.86), (0.82, 0.88), (0.84, 0.90)], 1):
            trial(tracker, "standard", "mrpc", 1e-4, seed, mrpc(a, f))
        for seed, (a, f) in enumerate([(0.70, 0.80), (0.90, 0.92), (0.86, 0.90)], 1):
            trial(tracker, "standard", "mrpc", 2e-5, seed, mrpc(a, f))
        for seed, (m, mm) in enumerate([(0.60, 0.61), (0.70, 0.69), (0.65, 0.66)], 1):
            metrics = {"validation_matched/accuracy": m, "validation_matched/score": m,
                       "validation_mismatched/accuracy": mm, "validation_mismatched/score": mm}  # fmt: skip
            trial(tracker, "standard", "mnli", 1e-4, seed, metrics)
        for seed, a in enumerate([0.9, 0.8], 1):
            trial(tracker, "shared", "mrpc", 1e-4, seed, mrpc(a, a))
        with (
            pytest.raises(RuntimeError),
            tracker.run(
                "crashed",
                {KIND: "glue_trial", VARIANT: "standard", TASK: "mrpc"},
                {"learning_rate": 1e-4, "seed": 4},
            ) as rid,
        ):
            tracker.log(rid, {f"best/{k}": v for k, v in mrpc(0.0, 0.0).items()})
            raise RuntimeError("a failed run is not counted")
        trial(
            tracker,
            "standard",
            "squad1.1",
            1e-4,
            1,
            {"validation/exact": 80.0, "validation/f1": 88.0},
            "squad_trial",
        )
        for variant, curves in {
            "standard": {0: [0.9, 0.8, 0.7], 1: [0.9, 0.7, 0.5]},
            "shared": {0: [0.95, 0.9, 0.85]},
        }.items():
            for seed, curve in curves.items():
                tags = {KIND: "noise", VARIANT: variant, TASK: "sst2"}
                with tracker.run("noise", tags, {"noise_seed": seed}) as rid:
                    for level, value in zip([0, 5, 10], curve):
                        tracker.log(
                            rid, {"validation/score": value, "validation/accuracy": value}, step=level
                        )
        with tracker.run("cross", {KIND: "cross_domain", VARIANT: "standard", TASK: "mnli"}) as rid:
            tracker.log(rid, {"qnli/validation/accuracy": 0.6, "mnli/validation_matched/accuracy": 0.8})
    with tracker.sweep("second", "glue_sweep"):
        trial(
            tracker, "standard", "mrpc", 2e-5, 1, mrpc(0.90, 0.92)
        )  # a re-run replaces seed 1, not a 4th seed
    return root, first


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_tables_from_a_store(store, tmp_path, capsys):
    root, _ = store
    assert report_main(["--runs-dir", str(root), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "table1_glue.md").read_text().splitlines()
    assert md[2] == "| Model | MNLI-m (Acc) | MNLI-mm (Acc) | MRPC (Acc/F1) | Avg |"
    # standard MRPC at lr 2e-5 after the re-run: acc (.90 .90 .86), F1 (.92 .92 .90); Avg of .65 .66 .91
    assert md[4] == "| standard | 65.0 | 66.0 | 90.0/92.0 | 74.0 |"
    assert md[5] == "| shared | – | – | 85.0/85.0 | 85.0 |"  # variants as rows, paper order
    rows = read_csv(tmp_path / "table1_glue.csv")
    assert rows[0]["MRPC accuracy"] == "90.0" and rows[0]["seeds"] == "3"
    assert rows[0]["learning_rates"] == "mnli=0.0001 mrpc=2e-05"
    assert "| standard | 80.0/88.0 |" in (tmp_path / "table2_squad.md").read_text()
    noise = (tmp_path / "table5_noise.md").read_text().splitlines()
    assert noise[2] == "| Model | 0% | 5% | 10% |"
    assert noise[4:] == ["| standard | 90.0 | 75.0 | 60.0 |", "| shared | 95.0 | 90.0 | 85.0 |"]
    assert read_csv(tmp_path / "table5_noise.csv")[0]["10% std"] == "10.0"
    assert (tmp_path / "table5_noise.png").read_bytes()[:4] == b"\x89PNG"
    cross = (tmp_path / "table6_cross_domain.md").read_text().splitlines()
    assert cross[2] == "| Model | MNLI→MNLI-m | MNLI→QNLI |" and cross[4] == "| standard | 80.0 | 60.0 |"
    assert "Table 1: GLUE" in capsys.readouterr().out


def test_parent_filter_and_failed_runs(store):
    root, first = store
    collected = collect(f"sqlite:///{root / 'mlflow.db'}", "swbert-finetune", [first])
    std = sorted(
        (t.learning_rate, t.seed, t.metrics["validation"]["accuracy"])
        for t in collected.glue
        if t.task == "mrpc" and t.variant == "standard"
    )
    assert std == [
        (2e-5, 1, 0.70),
        (2e-5, 2, 0.90),
        (2e-5, 3, 0.86),
        (1e-4, 1, 0.80),
        (1e-4, 2, 0.82),
        (1e-4, 3, 0.84),
    ]


def test_empty_experiment_and_missing_store(store, tmp_path, capsys):
    root, _ = store
    Tracker(tracking_uri(root), "empty")  # an experiment with no runs
    assert report_main(["--runs-dir", str(root), "--experiment", "empty", "--out", str(tmp_path)]) == 1
    assert "no finished fine-tuning runs in experiment 'empty'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no MLflow experiment 'nope'"):
        report_main(["--runs-dir", str(root), "--experiment", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        report_main(["--runs-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
