"""Fine-tune checkpoints on SQuAD v1.1 and/or v2.0 (paper Table 2).

    python launchers/finetune_squad.py --checkpoint standard=ckpt/std shared=ckpt/shared \\
        --output-dir runs/squad [--version 1.1 2.0] [--train-file 1.1=train-v1.1.json --dev-file 1.1=dev-v1.1.json]
    deepspeed --num_gpus 8 launchers/finetune_squad.py --deepspeed zero1.json ...

Without --train-file/--dev-file the data comes from the Hub (rajpurkar/squad, rajpurkar/squad_v2).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from swbert.finetune import cli
from swbert.finetune.checkpoint import parse_checkpoints
from swbert.finetune.report import build_report, collect
from swbert.finetune.squad import SquadSweep, run_squad
from swbert.finetune.trainer import dist_info

log = logging.getLogger("swbert.finetune")


def _version_files(
    p: argparse.ArgumentParser, flag: str, specs: list[str], versions: list[str]
) -> dict[str, Path]:
    """``VERSION=PATH`` (or a bare PATH when only one version is run) -> {version: path}."""
    out = {}
    for spec in specs:
        version, sep, path = spec.partition("=")
        if not sep:
            if len(versions) != 1:
                p.error(f"{flag} {spec}: with several versions write VERSION=PATH (e.g. 2.0={spec})")
            version, path = versions[0], spec
        if version not in versions:
            p.error(f"{flag} {spec}: version {version} is not in --version {' '.join(versions)}")
        if not Path(path).is_file():
            p.error(f"{flag} {spec}: {path} not found")
        out[version] = Path(path)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_common_args(p, lrs=[1e-4], seeds=[1, 2, 3], epochs=3, batch_size=32)
    p.add_argument("--version", nargs="+", default=["1.1", "2.0"], choices=["1.1", "2.0"])
    p.add_argument(
        "--train-file", nargs="+", default=[], metavar="[VERSION=]PATH", help="official SQuAD train JSON"
    )
    p.add_argument(
        "--dev-file", nargs="+", default=[], metavar="[VERSION=]PATH", help="official SQuAD dev JSON"
    )
    p.add_argument("--max-seq-length", type=int, default=384)
    p.add_argument(
        "--doc-stride", type=int, default=128, help="overlap, in tokens, between a context's windows"
    )
    p.add_argument("--n-best", type=int, default=20, help="start/end candidates per window in span decoding")
    p.add_argument("--max-answer-length", type=int, default=30, help="longest answer span, in tokens")
    p.add_argument(
        "--null-threshold",
        type=float,
        default=0.0,
        help="v2.0: answer nothing when the no-answer score beats the best span by more than this",
    )
    args = p.parse_args(argv)
    args.train_files = _version_files(p, "--train-file", args.train_file, args.version)
    args.dev_files = _version_files(p, "--dev-file", args.dev_file, args.version)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cli.setup_logging()
    tracker = cli.open_tracker(args)
    sweep = SquadSweep(
        checkpoints=parse_checkpoints(args.checkpoint),
        versions=args.version,
        train_files=args.train_files,
        dev_files=args.dev_files,
        output_dir=args.output_dir,
        learning_rates=args.learning_rates,
        seeds=args.seeds,
        train=cli.train_config(args),
        max_seq_length=args.max_seq_length,
        doc_stride=args.doc_stride,
        n_best=args.n_best,
        max_answer_length=args.max_answer_length,
        null_threshold=args.null_threshold,
        attention_dropout=args.attention_dropout,
        max_train_samples=args.max_train_samples,
        max_eval_samples=args.max_eval_samples,
        keep=args.keep,
        tokenizer=args.tokenizer,
    )
    name = args.run_name or f"squad-{time.strftime('%Y%m%d-%H%M%S')}"
    params = {k: v for k, v in cli.flat_params(args).items() if k not in ("train_files", "dev_files")}
    with tracker.sweep(name, "squad_sweep", params) as parent:
        run_squad(sweep, tracker)
    if dist_info().is_main:
        tables = build_report(collect(tracker.uri, args.experiment, [parent]), args.output_dir / "report")
        tracker.log_artifacts(parent, args.output_dir / "report", "report")  # tables and figures
        for table in tables.values():
            print(table.markdown())
        log.info("tables written to %s (re-create them with launchers/report.py)", args.output_dir / "report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
