"""Start-up cost every rank pays: imports that a job does not use are kept out.

`import deepspeed` imports its autotuner, whose module imports MLflow (with pandas, sqlalchemy,
fastapi: about 2 s of CPU per process) only to log autotuning experiments, which run under
`deepspeed --autotuning`, never in a swbert rank. The finder below makes that one import fail,
as it would without MLflow installed (DeepSpeed catches it); every other `import mlflow`,
including swbert's own tracking on rank 0, imports it as usual.
"""

from __future__ import annotations

import importlib.abc
import sys

_IMPORTER = "deepspeed.autotuning.autotuner"


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mlflow":
            return None
        frame = sys._getframe(1)
        for _ in range(12):  # the import statement, under a few of importlib's own frames
            if frame is None:
                break
            if frame.f_globals.get("__name__") == _IMPORTER:
                raise ModuleNotFoundError(f"mlflow is not imported for {_IMPORTER} (swbert/_startup.py)")
            frame = frame.f_back
        return None


# Installed on import (swbert/__init__.py imports this module first), before DeepSpeed is imported.
if _IMPORTER not in sys.modules and not any(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path):
    sys.meta_path.insert(0, _NoMlflowForTheAutotuner())
