"""Logging for every entry point: library code logs, and the entry point decides where it goes.

Two streams, as users of training jobs expect them:

- `status` lines (`swbert.status`): what a person running the job reads as it goes (the resolved
  config, where a run resumed, a pre-emption), on standard output, rank 0 only;
- everything else (`swbert.*`, and the libraries' warnings) on standard error with a timestamp:
  INFO on rank 0, warnings and errors on every rank.
"""

from __future__ import annotations

import logging
import os
import sys

STATUS = "swbert.status"
status = logging.getLogger(STATUS)

# libraries whose per-shard or per-migration chatter drowns the progress
QUIET = ("megatron", "mlflow.store.db.utils", "alembic")


def setup_logging(rank: int | None = None) -> None:
    """Configure the root logger and the status stream for this process (rank from the environment
    when not given). Safe to call more than once."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
    )
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    status.propagate = False
    status.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(getattr(h, "_swbert_status", False) for h in status.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._swbert_status = True  # type: ignore[attr-defined]
        status.addHandler(handler)
