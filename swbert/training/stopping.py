"""How a run stops on request: the exit status of a pre-empted run, and signals acknowledged at once.

A pre-empted run (SIGTERM or SIGUSR1 from SLURM or torchrun, or Ctrl-C) checkpoints at the end of
its step and exits with `PREEMPTED_EXIT`, 75 (`EX_TEMPFAIL` of sysexits.h: "try again later"), so a
scheduler's requeue logic can tell it from a finished run (0), bad input (2) and a failure (3).

Python runs a signal handler only between bytecodes of the main thread: during a long step (one
huge kernel, a collective waiting on a slow rank) nothing was said until the step ended, and a
run looked deaf. `acknowledge_at_once` has the C-level handler write the signal number to a
socket (`signal.set_wakeup_fd`), read by a thread that prints one line at once; the trainer's own
handler still stops the run at the next safe point, the end of the step.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

from swbert.runtime.exits import PREEMPTED_EXIT


def acknowledgement(signum: int) -> str:
    name = signal.Signals(signum).name
    return (
        f"{name} received: checkpointing at the end of this step, then stopping "
        f"(exit status {PREEMPTED_EXIT}; resume with --resume auto)\n"
    )


def acknowledge_at_once(signals: tuple[signal.Signals, ...]) -> bool:
    """From the main thread, once Python handlers for `signals` are installed: print
    `acknowledgement` the moment one arrives, whatever the main thread is doing. Returns False
    when it cannot (not the main thread, or no wakeup fd); the handler must say it then."""
    wanted = {int(s) for s in signals}
    try:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        return False

    def watch() -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            for signum in data:
                if signum in wanted:
                    os.write(2, acknowledgement(signum).encode())

    threading.Thread(target=watch, name="swbert-signal-ack", daemon=True).start()
    _KEEP.append((reader, writer))  # open for the process's life
    return True


_KEEP: list[tuple[socket.socket, socket.socket]] = []
