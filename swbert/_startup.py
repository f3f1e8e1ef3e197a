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
"""

from __future__ import annotations

import sys
from types import ModuleType

_UNUSED = "mlflow"


def import_deepspeed() -> ModuleType:
    """`import deepspeed`; the first time in a process, without importing MLflow for its autotuner."""
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
