"""Masked-LM pretraining of a swbert model with DeepSpeed.

    deepspeed --num_gpus 8 launchers/pretrain.py --config base_shared --data-dir data/wiki
    torchrun --nproc_per_node 2 launchers/pretrain.py --size tiny --train-steps 20
    deepspeed launchers/pretrain.py            # the embedded default recipe, on any machine
    torchrun --nproc_per_node 8 -m swbert.launchers.pretrain ...   # the same, as a module

Exit status: 0 finished, 2 bad input (nothing started), 3 failed (a lost rank, a write that
failed, non-finite steps), 75 pre-empted (SIGTERM/SIGUSR1/Ctrl-C: checkpointed, resume with
--resume auto). Run with --help for every option. Without --data-dir, the embedded default
corpus is built first (once, under SWBERT_DATA_HOME or runs/data; every rank waits on one lock
while one builds it).
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> None:
    from swbert.logs import setup_logging, status
    from swbert.training.cli import closing_summary, parse_args

    setup_logging()  # first: the default corpus's build below says what it does
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        if config.data_dir is None and not config.data_mix:  # offline preprocessing, before any process group
            from data_prep.default_corpus import default_root, ensure_default_data

            status.info(
                "data: the embedded default corpus under %s (no --data-dir; built on first use)",
                default_root(),
            )
            config.data_dir = str(ensure_default_data(tokenizer=config.tokenizer))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from swbert.runtime.dist import LostRanks
    from swbert.training.checkpoint import CheckpointSaveError
    from swbert.training.loop import NonFiniteStop
    from swbert.training.metrics import MetricsWriteError
    from swbert.training.runlock import RunFolderBusy
    from swbert.training.trainer import run

    try:
        summary = run(config)
    except (NonFiniteStop, CheckpointSaveError, MetricsWriteError, LostRanks) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
    except (ValueError, FileNotFoundError, RunFolderBusy) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if summary.get("is_main") and summary.get("status") == "FINISHED":  # exported or not
        print(closing_summary(summary), flush=True)
    if summary.get("status") == "KILLED":  # pre-empted: checkpointed on request, not finished
        from swbert.runtime.exits import PREEMPTED_EXIT

        sys.exit(PREEMPTED_EXIT)


def hard_exit(code: int) -> None:
    """Leave without the interpreter's teardown, once everything is written and closed.

    After a finished run, the C++ destructors of gloo's and DeepSpeed's shared-memory communicators
    can race with Python's finalisation and abort a rank ("terminate called without an active
    exception"), turning a successful job into a failed one for its launcher."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as done:
        hard_exit(done.code if isinstance(done.code, int) else 1)
    hard_exit(0)
