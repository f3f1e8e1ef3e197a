"""Fine-tune checkpoints on GLUE (paper Table 1), optionally with noise (Table 5) and cross-domain (Table 6).

    python launchers/finetune_glue.py --checkpoint standard=ckpt/std shared=ckpt/shared \\
        --output-dir runs/glue [--data-dir glue_data] [--noise] [--cross-domain]
    deepspeed --num_gpus 8 launchers/finetune_glue.py --deepspeed zero1.json ...

Already fine-tuned models (one folder per task, grouped by NAME) can be evaluated without training:

    python launchers/finetune_glue.py --evaluate-finetuned --checkpoint shared=runs/glue/shared/mnli/... \\
        shared=runs/glue/shared/qnli/... --output-dir runs/eval --noise --cross-domain
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from swbert.finetune import cli
from swbert.finetune.checkpoint import parse_checkpoints
from swbert.finetune.glue import GlueSweep, evaluate_finetuned, run_glue
from swbert.finetune.report import build_report, collect
from swbert.finetune.robustness import DEFAULT_LEVELS
from swbert.finetune.tasks import GLUE_TASKS
from swbert.finetune.trainer import dist_info

log = logging.getLogger("swbert.finetune")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_common_args(p, lrs=[1e-4, 2e-5, 2e-6], seeds=[1, 2, 3, 4, 5], epochs=10, batch_size=32)
    p.add_argument(
        "--tasks",
        nargs="+",
        default=list(GLUE_TASKS),
        choices=list(GLUE_TASKS),
        metavar="TASK",
        help=f"GLUE tasks (default: all of {' '.join(GLUE_TASKS)}; mnli covers matched and mismatched)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        help="GLUE TSV root (CoLA/train.tsv, MNLI/dev_matched.tsv, ...); default: the Hub",
    )
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument(
        "--hidden-dropout",
        type=float,
        help="hidden_dropout_prob during fine-tuning (default: the checkpoint's)",
    )
    p.add_argument(
        "--noise",
        action="store_true",
        help=f"evaluate kept models under embedding noise at {list(DEFAULT_LEVELS)}",
    )
    p.add_argument(
        "--noise-levels",
        type=float,
        nargs="+",
        metavar="FRACTION",
        help="custom noise levels (implies --noise)",
    )
    p.add_argument("--noise-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--cross-domain",
        action="store_true",
        help="evaluate kept MNLI/QNLI/QQP/MRPC models on each other's dev sets",
    )
    p.add_argument(
        "--evaluate-finetuned",
        action="store_true",
        help="--checkpoint folders are already fine-tuned GLUE models: only run --noise / --cross-domain",
    )
    args = p.parse_args(argv)
    if args.noise and not args.noise_levels:
        args.noise_levels = list(DEFAULT_LEVELS)
    if args.evaluate_finetuned and not (args.noise_levels or args.cross_domain):
        p.error("--evaluate-finetuned needs --noise, --noise-levels or --cross-domain")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cli.setup_logging()
    tracker = cli.open_tracker(args)
    checkpoints = parse_checkpoints(args.checkpoint)
    name = args.run_name or f"glue-{time.strftime('%Y%m%d-%H%M%S')}"
    with tracker.sweep(name, "glue_sweep", cli.flat_params(args)) as parent:
        if args.evaluate_finetuned:
            evaluate_finetuned(
                checkpoints,
                args.data_dir,
                tracker,
                args.max_seq_length,
                args.noise_levels,
                args.noise_seeds,
                args.cross_domain,
                args.max_eval_samples,
                args.eval_batch_size,
            )
        else:
            sweep = GlueSweep(
                checkpoints=checkpoints,
                tasks=args.tasks,
                data_dir=args.data_dir,
                output_dir=args.output_dir,
                learning_rates=args.learning_rates,
                seeds=args.seeds,
                train=cli.train_config(args),
                max_seq_length=args.max_seq_length,
                attention_dropout=args.attention_dropout,
                hidden_dropout=args.hidden_dropout,
                max_train_samples=args.max_train_samples,
                max_eval_samples=args.max_eval_samples,
                keep=args.keep,
                noise_levels=args.noise_levels or [],
                noise_seeds=args.noise_seeds,
                cross_domain=args.cross_domain,
                tokenizer=args.tokenizer,
            )
            run_glue(sweep, tracker)
    if dist_info().is_main:
        tables = build_report(collect(tracker.uri, args.experiment, [parent]), args.output_dir / "report")
        tracker.log_artifacts(parent, args.output_dir / "report", "report")  # tables and figures
        for table in tables.values():
            print(table.markdown())
        log.info("tables written to %s (re-create them with launchers/report.py)", args.output_dir / "report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
