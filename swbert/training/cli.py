"""Command line of `launchers/pretrain.py`: a recipe plus `--key value` overrides."""

from __future__ import annotations

import dataclasses
import sys

from swbert.training.config import RECIPES_DIR, TrainConfig, build_config, field_descriptions

DEFAULT_RECIPE = "default"


def _type_name(tp: object) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("Literal[", "one of [")


def _help() -> str:
    lines = [
        "usage: deepspeed [--num_gpus N] launchers/pretrain.py [--config RECIPE] [--key value ...]",
        "       torchrun --nproc_per_node N launchers/pretrain.py [--config RECIPE] [--key value ...]",
        "       swbert-pretrain [--config RECIPE] [--key value ...]   (one process, or under srun)",
        "",
        f"--config RECIPE   a YAML/TOML recipe, or a shipped one: "
        f"{', '.join(sorted(p.stem for p in RECIPES_DIR.glob('*.yaml')))} (default: {DEFAULT_RECIPE})",
        "",
        "Every config key can be overridden as --key value (dashes or underscores):",
    ]
    described = field_descriptions()
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  --{f.name.replace('_', '-'):<24} {_type_name(f.type)}, default: {default!r}")
        if f.name in described:
            lines.append(f"  {'':<26} {described[f.name]}")
    lines.append("\nThe resolved config is printed and saved as <output_dir>/resolved_config.yaml.")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> TrainConfig:
    recipe: str | None = DEFAULT_RECIPE
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(_help())
            sys.exit(0)
        if arg.startswith(("--local_rank", "--local-rank")):  # added by the deepspeed launcher
            i += 1 if "=" in arg else 2
            continue
        if arg == "--config":
            if i + 1 >= len(argv):
                raise SystemExit("--config needs a recipe file or name")
            recipe, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            recipe, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    return build_config(recipe, rest)


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from swbert.training.checkpoint import CheckpointSaveError
    from swbert.training.dist import LostRanks
    from swbert.training.runlock import RunFolderBusy
    from swbert.training.trainer import NonFiniteStop, run

    try:
        summary = run(config)
    except (NonFiniteStop, CheckpointSaveError, LostRanks) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
    except (ValueError, FileNotFoundError, RunFolderBusy) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if "export_dir" in summary:
        print(closing_summary(summary), flush=True)


def closing_summary(summary: dict) -> str:
    """What rank 0 prints at the end: how the loss went, and where the model, metrics and MLflow run are."""
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
    lines += [
        f"  model (Hugging Face folder): {summary['export_dir']}",
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


if __name__ == "__main__":  # python -m swbert.training.cli, e.g. under torchrun -m
    main()
