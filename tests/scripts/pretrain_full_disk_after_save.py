"""`launchers/pretrain.py` whose rank 0 meets a full disk right after its first checkpoint.

When rank 0 moves `checkpoints/latest` into place (the end of the first save), its file size limit
(RLIMIT_FSIZE) drops to the size of metrics.jsonl plus 10 bytes: the next record is cut off by the
kernel with EFBIG, as a full disk cuts a write with ENOSPC. SIGXFSZ is ignored, so the write fails
instead of killing the process (what a full disk does too).
"""

import os
import resource
import signal
import sys

if os.environ.get("RANK") == "0":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    done = []

    def _full_after_first_save(event: str, args: tuple) -> None:
        if event == "os.rename" and not done and os.fspath(args[1]).endswith("checkpoints/latest"):
            done.append(True)
            metrics = os.path.join(os.path.dirname(os.path.dirname(os.fspath(args[1]))), "metrics.jsonl")
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(metrics) + 10, hard))

    sys.addaudithook(_full_after_first_save)

from swbert.launchers.pretrain import main  # noqa: E402  (after the hook: nothing of it is needed before)

main()
