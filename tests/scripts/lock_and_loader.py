"""A stand-in for rank 0: takes the run lock of OUTPUT_DIR, starts its loader workers (forked, as
the trainer's are), prints the workers' pids and waits to be killed.

    python tests/scripts/lock_and_loader.py OUTPUT_DIR
"""

import sys
import time
import types
from pathlib import Path

import psutil
import torch

# The packages' __init__ files only re-export (and import the models, and so transformers): empty
# stand-ins let the two modules needed here load in the time torch takes, as the real rank's would.
REPO = Path(__file__).resolve().parents[2]
for name in ("swbert", "swbert.data", "swbert.training"):
    package = types.ModuleType(name)
    package.__path__ = [str(REPO.joinpath(*name.split(".")))]
    sys.modules[name] = package

from swbert.data.loader import batch_loader  # noqa: E402
from swbert.training.runlock import RunLock  # noqa: E402


class Stream:
    """Large micro-batches (~1 MB each), so the workers fill the pipe to the main process, as a real
    loader's prefetch does."""

    def batch(self, position: int, micro_bs: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((micro_bs, 65536), position % 1000)}


lock = RunLock(Path(sys.argv[1])).acquire()  # held while this process lives
loader = batch_loader(Stream(), 0, 4, 0, 1, num_workers=2, prefetch_factor=4)
next(loader)
time.sleep(1.0)  # let the workers fill their queues
print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
time.sleep(600)
