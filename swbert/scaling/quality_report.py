"""The quality study's outputs: fits.json, points.csv, plots and the MLflow runs.

fits.json holds, per variant, L(N) against non-embedding parameters and L(C) against training
FLOPs (fitted parameters with intervals, see `swbert.scaling.fit`), the points each fit used and
those it left out with their reason, and each variant's parameter efficiency against the
reference variant: the reference's non-embedding parameter count that reaches the variant's loss,
at every measured size and at the `--extrapolate-to` sizes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from swbert.models.config import SIZES, SWBertConfig
from swbert.scaling.fit import Fit, FitError, equivalent_size, fit_power_law
from swbert.scaling.report import line_style, write_csv

PLOTS = {"non_embedding_params": "loss_vs_params", "train_flops": "loss_vs_flops"}
POINT_KEYS = ("name", "size", "seed", "params", "non_embedding_params", "tokens", "train_flops", "val_loss")


def fit_variant(rows: list[dict[str, Any]], x_key: str, draws: int, level: float) -> tuple[Fit | None, str]:
    """The variant's fit of held-out loss against `x_key`, or None and why it could not be made."""
    done = [r for r in rows if r["status"] == "done"]
    try:
        fit = fit_power_law([r[x_key] for r in done], [r["val_loss"] for r in done], draws=draws, level=level)
    except FitError as err:
        return None, str(err)
    return fit, ""


def extrapolation_sizes(names: list[str], attention: str) -> list[float]:
    """Non-embedding parameters of each `--extrapolate-to` entry: a size name or a number."""
    from swbert.scaling.quality import non_embedding_params

    out = []
    for name in names:
        if name in SIZES:
            out.append(float(non_embedding_params(SWBertConfig.from_size(name, attention_type=attention))))
        else:
            try:
                out.append(float(name))
            except ValueError:
                raise ValueError(f"--extrapolate-to {name}: neither a size nor a parameter count") from None
    return out


def build_fits(cfg: Any, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Fit]]:
    """fits.json's content, and the L(N) fits by variant (for the plots)."""
    variants: dict[str, Any] = {}
    by_n: dict[str, Fit] = {}
    for attention in dict.fromkeys(cfg.attentions):
        mine = [r for r in rows if r["attention"] == attention]
        entry: dict[str, Any] = {
            "points": [{k: r[k] for k in POINT_KEYS} for r in mine if r["status"] == "done"],
            "excluded": [{"name": r["name"], "reason": r["reason"]} for r in mine if r["status"] != "done"],
        }
        for label, key in (("L(N)", "non_embedding_params"), ("L(C)", "train_flops")):
            fit, why = fit_variant(mine, key, cfg.bootstrap, cfg.level)
            entry[label] = fit.to_json() if fit else {"error": why}
            if fit and label == "L(N)":
                by_n[attention] = fit
        variants[attention] = entry
    efficiency: dict[str, Any] = {}
    reference = by_n.get(cfg.reference)
    for attention, fit in by_n.items():
        if attention == cfg.reference or reference is None:
            continue
        measured = sorted({r["non_embedding_params"] for r in rows if r["attention"] == attention})
        named = extrapolation_sizes(cfg.extrapolate_to, attention)
        efficiency[attention] = {
            "reference": cfg.reference,
            "measured": equivalent_size(fit, reference, measured)["at"],
            "extrapolated": dict(zip(cfg.extrapolate_to, equivalent_size(fit, reference, named)["at"]))
            if named
            else {},
        }
    spec = {
        "x": "non-embedding parameters (L(N)); training FLOPs = tokens x train_flops_per_token (L(C))",
        "budget": f"tokens = {cfg.tokens_per_param} x non-embedding parameters",
        "level": cfg.level,
    }
    return {"study": spec, "variants": variants, "efficiency": efficiency}, by_n


def write_outputs(cfg: Any, rows: list[dict[str, Any]], recorder: Any) -> dict[str, Any]:
    """fits.json, points.csv and plots/ under cfg.output_dir (and to MLflow); returns the fits."""
    out = Path(cfg.output_dir)
    fits, by_n = build_fits(cfg, rows)
    fits_path = out / "fits.json"
    text = json.dumps(fits, indent=2, default=float) + "\n"
    plots = [out / "plots" / f"{name}.png" for name in PLOTS.values()]
    unchanged = fits_path.is_file() and fits_path.read_text() == text and all(p.is_file() for p in plots)
    fits_path.write_text(text)
    csv_path = write_csv(rows, out / "points.csv")
    if not unchanged:  # a re-run that found every point finished draws the same plots: keep them
        plots = plot_fits(rows, by_n, fits, out / "plots", cfg.level)
    if recorder is not None:
        recorder.study(fits, [fits_path, csv_path, *plots])
    return fits


def plot_fits(
    rows: list[dict[str, Any]], by_n: dict[str, Fit], fits: dict[str, Any], folder: Path, level: float
) -> list[Path]:
    """loss_vs_params.png and loss_vs_flops.png: points, fitted curves and their bands, one line
    style per variant; nothing without matplotlib (then the JSON and CSV are the output)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for (key, name), label in zip(PLOTS.items(), ("L(N)", "L(C)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for attention, entry in fits["variants"].items():
            done = [r for r in rows if r["attention"] == attention and r["status"] == "done"]
            if not done:
                continue
            xs = np.array([r[key] for r in done], dtype=float)
            line = ax.scatter(xs, [r["val_loss"] for r in done], label=attention, s=18)
            if "E" in entry[label]:
                fit = fit_power_law(xs, [r["val_loss"] for r in done], draws=200, level=level)
                grid = np.geomspace(xs.min() / 1.5, xs.max() * 1.5, 100)
                ax.plot(grid, fit.law.loss(grid), line_style(attention), color=line.get_facecolor()[0])
                lo, hi = fit.band(grid)
                ax.fill_between(grid, lo, hi, alpha=0.15, color=line.get_facecolor()[0])
        ax.set_xscale("log")
        ax.set_xlabel("non-embedding parameters" if key == "non_embedding_params" else "training FLOPs")
        ax.set_ylabel("held-out MLM loss")
        ax.set_title(f"{label}: E + A x^-alpha, {level:.0%} bands")
        ax.legend()
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.13, top=0.9)
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


RUN_ID = "mlflow_run_id"  # the run's id, in the study's folder and in each point's (as pretraining keeps it)


class Recorder:
    """MLflow: one parent run for the study, a nested run per point holding its loss curve. A re-run
    of the study continues its parent run and logs only the points trained since (or never logged),
    as a resumed pretraining run continues its own run; a store that no longer has the parent (a
    new MLFLOW_TRACKING_URI, a deleted run, another --experiment) gets a new one with every point."""

    def __init__(self, cfg: Any) -> None:
        import mlflow

        from swbert.runtime.tracking import experiment_id, tracking_uri

        self.mlflow = mlflow
        self.output_dir = Path(cfg.output_dir)
        uri = tracking_uri(self.output_dir)
        mlflow.set_tracking_uri(uri)
        self.experiment = experiment_id(uri, cfg.experiment)
        mlflow.set_experiment(experiment_id=self.experiment)
        saved = _live_run(mlflow, self.output_dir / RUN_ID, self.experiment)
        self.fresh = saved is None  # a new parent: every point is logged under it
        if saved is not None:
            mlflow.start_run(run_id=saved)
            return
        run = mlflow.start_run(run_name=f"quality-{time.strftime('%Y%m%d-%H%M%S')}")
        (self.output_dir / RUN_ID).write_text(run.info.run_id)
        spec = {k: (",".join(map(str, v)) if isinstance(v, list) else str(v)) for k, v in asdict(cfg).items()}
        mlflow.log_params(spec)

    def point(self, row: dict[str, Any], curve: list[dict[str, float]]) -> None:
        mlflow = self.mlflow
        id_file = self.output_dir / "points" / row["name"] / RUN_ID
        logged = None if self.fresh else _live_run(mlflow, id_file, self.experiment)
        if logged is not None and not row["trained_now"]:
            return  # logged by an earlier run of the study and unchanged since
        with mlflow.start_run(run_id=logged, run_name=row["name"], nested=True) as run:
            if logged is None:
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(run.info.run_id)
                mlflow.log_params(
                    {
                        k: row[k]
                        for k in ("size", "attention", "seed", "tokens", "steps", "lr", "warmup_steps")
                    }
                )
            mlflow.set_tags({"status": row["status"], "reason": str(row["reason"])[:5000]})
            numbers = {
                k: row[k] for k in ("params", "non_embedding_params", "train_flops", "val_loss", "wall_s")
            }
            mlflow.log_metrics({k: float(v) for k, v in numbers.items() if v is not None})
            for record in curve:
                step = int(record["step"])
                mlflow.log_metrics({k: v for k, v in record.items() if k in ("loss", "val_loss")}, step=step)

    def study(self, fits: dict[str, Any], artifacts: list[Path]) -> None:
        for attention, entry in fits["variants"].items():
            law = entry["L(N)"]
            if "alpha" in law:
                self.mlflow.log_metrics({f"{attention}.alpha": law["alpha"], f"{attention}.E": law["E"]})
        for path in artifacts:
            self.mlflow.log_artifact(str(path))

    def close(self) -> None:
        self.mlflow.end_run()


def _live_run(mlflow: Any, id_file: Path, experiment: str) -> str | None:
    """The run id saved in `id_file` if the current store still has that run, not deleted, in
    `experiment` (another --experiment starts a new parent)."""
    if not id_file.is_file():
        return None
    run_id = id_file.read_text().strip()
    try:
        run = mlflow.MlflowClient().get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return None
    return run_id if run.info.lifecycle_stage == "active" and run.info.experiment_id == experiment else None
