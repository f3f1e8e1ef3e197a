"""Report the DeepSpeed accelerator this process runs with, for the tests of tests/launch_utils.py.

    python tests/scripts/which_accelerator.py   # under tests/launch_utils.launch(1, [], env=...)

Prints one JSON line: `accelerator`, the class `deepspeed.accelerator.get_accelerator()` returns,
and `preloaded`, whether DeepSpeed was imported before the script ran (a rank forked from the fork
server, which has imported it, rather than started in a fresh interpreter).
"""

import json
import sys

preloaded = "deepspeed" in sys.modules  # before this script imports it

from deepspeed.accelerator import get_accelerator  # noqa: E402 - after the check above

print(json.dumps({"accelerator": type(get_accelerator()).__name__, "preloaded": preloaded}))
