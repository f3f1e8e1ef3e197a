"""Start-up cost every rank pays: an import a job does not use, kept out where swbert imports DeepSpeed.

`import deepspeed` imports its autotuner, whose module imports MLflow (with pandas, sqlalchemy,
fastapi: about 2 s of CPU per process) only to log autotuning experiments, which run under
`deepspeed --autotuning`, never in a swbert rank. `import_deepspeed` imports DeepSpeed with that
import failing, as it would without MLflow installed (DeepSpeed catches it), and then leaves the
import system as it found it: a later `import mlflow`, such as swbert's own tracking on rank 0,
imports it as usual.

Nothing here runs on `import swbert`, which changes no import machinery: the saving holds in a
process whose first import of DeepSpeed is this function's (`swbert.runtime.dist.init_distributed`
calls it before a rank's process group starts).

It also gives DeepSpeed's JIT-built ops this environment's own build folder when
TORCH_EXTENSIONS_DIR is not set (`extensions_dir`): the Makefile's folder, so a job started with
`torchrun` or `deepspeed` directly finds the ops `make setup` built instead of building them again
into torch's shared default cache, where another environment's torch would break them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

_UNUSED = "mlflow"


def extensions_dir() -> Path:
    """This environment's build folder of DeepSpeed's ops: ~/.cache/swbert/torch_extensions/<cksum of
    the environment's absolute path>, as the Makefile computes it (`echo $(abspath $(VENV)) | cksum`)."""
    venv = f"{os.path.abspath(sys.prefix)}\n"
    cksum = subprocess.run(["cksum"], input=venv, capture_output=True, text=True, check=True)
    return Path.home() / ".cache" / "swbert" / "torch_extensions" / cksum.stdout.split()[0]


def use_own_extensions_dir() -> None:
    """TORCH_EXTENSIONS_DIR set to `extensions_dir()` unless it is set (and not empty) already."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())


def import_deepspeed() -> ModuleType:
    """`import deepspeed`; the first time in a process, without importing MLflow for its autotuner.
    DeepSpeed's ops build in this environment's own folder (`use_own_extensions_dir`)."""
    use_own_extensions_dir()
    if "deepspeed" in sys.modules or _UNUSED in sys.modules:
        import deepspeed

        return deepspeed
    # None in sys.modules makes `import mlflow` raise ModuleNotFoundError (the import system's own
    # rule); for the duration of this import only, and only in the module table, which is restored
    sys.modules[_UNUSED] = None
    try:
        import deepspeed
    finally:
        if _UNUSED in sys.modules and sys.modules[_UNUSED] is None:
            del sys.modules[_UNUSED]
    return deepspeed
