"""A process whose main thread is stuck in one long call (as in a huge step, or a collective that
waits on a slow rank) when a stop signal comes: swbert's acknowledgement must still come at once.

    python tests/scripts/busy_when_signalled.py   # prints "busy", then sleeps 4 s in C code

The trainer's own handler (here: one that prints "handled") runs only after the call returns.
Loaded by path: swbert.training.stopping needs nothing of the package (no torch), so this starts fast.
"""

import importlib.util
import os
import signal
import sys
from pathlib import Path

path = Path(__file__).resolve().parents[2] / "swbert" / "training" / "stopping.py"
spec = importlib.util.spec_from_file_location("stopping", path)
stopping = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stopping)

signal.signal(signal.SIGTERM, lambda *_: print("handled", flush=True))
assert stopping.acknowledge_at_once((signal.SIGTERM,))
print("busy", flush=True)
os.system("sleep 4")  # one C call (system + waitpid), the GIL released, as a long kernel is
print("returned", flush=True)
sys.exit(0)
