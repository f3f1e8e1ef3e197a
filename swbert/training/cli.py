"""Command line of pretraining: a recipe plus `--key value` overrides (`swbert.cli`), and the
closing summary. The entry point is `launchers/pretrain.py`."""

from __future__ import annotations

from collections.abc import Sequence

from swbert import cli
from swbert.training.config import RECIPES_DIR, TrainConfig

DEFAULT_RECIPE = "default"
USAGE = "\n".join(
    [
        "usage: deepspeed [--num_gpus N] launchers/pretrain.py [--config RECIPE] [--key value ...]",
        "       torchrun --nproc_per_node N launchers/pretrain.py [--config RECIPE] [--key value ...]",
        "       swbert-pretrain [--config RECIPE] [--key value ...]   (one process, or under srun)",
        "The resolved config is saved as <output_dir>/resolved_config.yaml (one line names it).",
    ]
)


def _help() -> str:
    return cli.help_text(TrainConfig, USAGE, DEFAULT_RECIPE, RECIPES_DIR)


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """`[--config RECIPE] [--key value ...]` -> the checked `TrainConfig` (`--help` prints and exits)."""
    return cli.parse_cli(TrainConfig, argv, USAGE, DEFAULT_RECIPE, RECIPES_DIR)


def closing_summary(summary: dict) -> str:
    """What rank 0 prints at the end of a finished run, exported or not: how the loss went, and where
    the model, metrics and MLflow run are."""
    out = summary["output_dir"]
    lines = [f"\ndone: {summary['step']} steps"]
    if "first_logged" in summary:
        first, last = summary["first_logged"], summary["last_logged"]
        lines.append(
            f"  loss:                        {first['loss']:.4f} at step {first['step']} -> "
            f"{last['loss']:.4f} at step {last['step']}"
        )
        if "val_loss" in last:
            lines.append(f"  validation loss, perplexity: {last['val_loss']:.4f}, {last['val_ppl']:.2f}")
    if summary.get("step_s"):
        wait = summary["data_wait_s"] / summary["step_s"]
        lines.append(f"  waiting for data:            {100 * wait:.2f}% of the training time")
    export = summary.get("export_dir")
    if export is None:  # --export false
        export = (
            f"not written (--export false); python -m swbert.training.export {out}/checkpoints --output DIR"
        )
    lines += [
        f"  model (Hugging Face folder): {export}",
        f"  metrics:                     {out}/metrics.jsonl",
        f"  checkpoints:                 {out}/checkpoints",
    ]
    uri = summary.get("mlflow_uri")
    if uri is None:
        lines.append("  MLflow:                      disabled")
    elif uri.startswith(("http://", "https://")):
        lines.append(f"  MLflow tracking server:      {uri} (open it in a browser)")
    else:
        lines.append(f"  MLflow store:                {uri}")
        lines.append(f"  open the MLflow UI with:     mlflow ui --backend-store-uri {uri}")
    return "\n".join(lines)
