"""`launchers/pretrain.py` in which one rank meets a full disk from one checkpoint on.

SWBERT_TEST_FSIZE=RANK:TAG:BYTES: when rank RANK creates the folder TAG (the start of that save),
its file size limit (RLIMIT_FSIZE) drops to BYTES, so the kernel fails its larger writes with EFBIG
as a full disk fails them with ENOSPC. SIGXFSZ is ignored, so the write fails instead of killing
the process (what a full disk does too).
"""

import os
import resource
import signal
import sys

rank, tag, limit = os.environ["SWBERT_TEST_FSIZE"].split(":")
if os.environ.get("RANK") == rank:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def _limit_from_tag(event: str, args: tuple) -> None:
        if event == "os.mkdir" and os.fspath(args[0]).endswith(tag):
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))

    sys.addaudithook(_limit_from_tag)

from swbert.launchers.pretrain import main  # noqa: E402  (after the hook: nothing of it is needed before)

main()
