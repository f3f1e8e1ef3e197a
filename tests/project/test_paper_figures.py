"""End to end, tiny: two variants pretrained for a few steps, fine-tuned for one epoch at batch 16 (the
paper's Figure 3 measurement), and `launchers/report.py` drawing Figures 2 and 3 from those runs."""

from __future__ import annotations

import csv
import runpy

import pytest
import torch

from swbert.finetune.synthetic import write_glue_fixture
from tests.launch_utils import REPO, read_metrics, run_single

STEPS = 4


def launcher(name: str):
    return runpy.run_path(str(REPO / "launchers" / f"{name}.py"), run_name="launcher")["main"]


@pytest.mark.slow
def test_figures_2_and_3_from_pretraining_and_finetuning_runs(data_dir, tmp_path):
    runs = {}
    for variant in ("standard", "shared"):
        out = tmp_path / variant
        result = run_single(["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out),
                             "--attention-type", variant, "--train-steps", str(STEPS), "--log-interval", "1",
                             "--eval-interval", "2", "--save-interval", str(STEPS), "--mlflow", "false"])  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        runs[variant] = out
    glue = write_glue_fixture(tmp_path / "glue", ["sst2"], n_train=32, n_dev=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    try:
        argv = ["--checkpoint", *(f"{v}={p / 'export'}" for v, p in runs.items()), "--tasks", "sst2",
                "--data-dir", str(glue), "--output-dir", str(tmp_path / "ft"), "--epochs", "1", "--batch-size", "16",
                "--learning-rates", "1e-3", "--seeds", "1", "--max-seq-length", "32", "--keep", "none"]  # fmt: skip
        assert launcher("finetune_glue")(argv) == 0
    finally:
        torch.set_num_threads(threads)
    report = tmp_path / "report"
    argv = ["--runs-dir", str(tmp_path / "ft"), "--out", str(report),
            "--pretrain-runs", *(f"{v}={p}" for v, p in runs.items())]  # fmt: skip
    assert launcher("report")(argv) == 0

    with open(report / "figure2_pretrain_loss.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for variant, run in runs.items():  # every logged loss of each run, at its step
        logged = {s: m["loss"] for s, m in read_metrics(run).items()}
        assert {int(r["step"]): float(r["loss"]) for r in rows if r["variant"] == variant} == logged
        assert sorted(logged) == list(range(1, STEPS + 1))
    assert (report / "figure2_pretrain_loss.png").stat().st_size > 0

    table = (report / "figure3_finetune_time.md").read_text().splitlines()
    assert table[2] == "| Model | SST-2 |"
    assert table[4].startswith("| standard | ") and table[5].startswith("| shared | ") and "%)" in table[5]
    with open(report / "figure3_finetune_time.csv", newline="") as f:
        times = {r["variant"]: float(r["SST-2 seconds_per_epoch"]) for r in csv.DictReader(f)}
    assert set(times) == {"standard", "shared"} and all(t > 0 for t in times.values())
    assert (report / "figure3_finetune_time.png").stat().st_size > 0
