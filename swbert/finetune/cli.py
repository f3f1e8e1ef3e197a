"""Command-line pieces shared by the fine-tuning launchers: training flags, logging, the MLflow sweep."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from swbert.finetune.tracking import DEFAULT_EXPERIMENT, Tracker, tracking_uri
from swbert.finetune.trainer import TrainConfig, dist_info


def add_common_args(
    p: argparse.ArgumentParser, *, lrs: list[float], seeds: list[int], epochs: int, batch_size: int
) -> None:
    """Flags every fine-tuning launcher takes (defaults differ per launcher)."""
    p.add_argument(
        "--checkpoint",
        nargs="+",
        required=True,
        metavar="[NAME=]PATH",
        help="exported model folders (config.json, model.safetensors, tokenizer); NAME labels the table row "
        "(default: the attention type)",
    )
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder, when not the checkpoint's own")
    p.add_argument(
        "--output-dir",
        type=Path,
        required=True,
        help="fine-tuned models, the resolved config and (by default) mlflow.db",
    )
    p.add_argument(
        "--learning-rates",
        type=float,
        nargs="+",
        default=lrs,
        help="grid; the best median over seeds is reported",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=seeds,
        help="one fine-tuning run per seed; the median is reported",
    )
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=batch_size, help="global batch size (split over GPUs)")
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-ratio", type=float, default=0.1, help="fraction of steps with linear warm-up")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument(
        "--patience", type=int, default=0, help="stop after N epochs without a better dev score (0: never)"
    )
    p.add_argument("--max-steps", type=int, help="cap on optimiser steps per run (smoke tests)")
    p.add_argument(
        "--attention-dropout", type=float, default=0.1, help="attention_probs_dropout_prob during fine-tuning"
    )
    p.add_argument("--max-train-samples", type=int, help="use only the first N training examples")
    p.add_argument("--max-eval-samples", type=int, help="use only the first N dev examples")
    p.add_argument(
        "--keep",
        choices=["none", "median", "all"],
        default="median",
        help="fine-tuned models to keep on disk: the median seed's at the best learning rate, all, or none",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="auto: bf16 on GPU, fp32 on CPU; fp16 only under DeepSpeed",
    )
    p.add_argument(
        "--deepspeed",
        metavar="CONFIG",
        help="DeepSpeed JSON (a path or a ds_configs/ name, stages 0-2), used with a world size > 1",
    )
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
    p.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///<output-dir>/mlflow.db)",
    )
    p.add_argument("--run-name", help="name of the parent MLflow run (default: launcher and time)")
    p.add_argument(
        "--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm,
        patience=args.patience,
        precision=args.precision,
        max_steps=args.max_steps,
        deepspeed_config=args.deepspeed,
    )


def setup_logging() -> None:
    info = dist_info()
    logging.basicConfig(
        level=logging.INFO if info.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {info.rank}] %(name)s: %(message)s",
    )


def open_tracker(args: argparse.Namespace) -> Tracker:
    """The MLflow tracker (rank 0 only) after printing and saving the resolved arguments."""
    info = dist_info()
    resolved = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "local_rank"}
    if info.is_main:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(resolved, indent=2, default=str)
        logging.getLogger("swbert.finetune").info("resolved arguments:\n%s", text)
        (args.output_dir / f"args-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text + "\n")
    uri = args.tracking_uri or tracking_uri(args.output_dir)
    return Tracker(uri, args.experiment, enabled=info.is_main)


def flat_params(args: argparse.Namespace) -> dict[str, str]:
    """Arguments as MLflow params of the parent run (lists joined with spaces)."""
    out = {}
    for k, v in vars(args).items():
        if k == "local_rank" or v is None:
            continue
        out[k] = " ".join(map(str, v)) if isinstance(v, list) else str(v)
    return out
