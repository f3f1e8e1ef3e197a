"""What a process pays and changes at start-up: `import swbert` leaves the import system as it was,
and DeepSpeed imported through `swbert._startup` brings no MLflow for its autotuner."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch_utils import REPO, job_env


def fresh(code: str) -> list[str]:
    """The lines `code` prints in a new interpreter (nothing imported before it)."""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True, text=True, check=True
    )
    return out.stdout.split()


@pytest.mark.slow
def test_importing_swbert_changes_no_import_machinery():
    """Once its libraries are imported (transformers adds a finder of its own), `import swbert`
    leaves sys.meta_path and sys.path_hooks as they were, and no finder anywhere is swbert's."""
    code = (
        "import sys, torch, transformers\n"
        "finders, hooks = list(sys.meta_path), list(sys.path_hooks)\n"
        "import swbert, swbert.models\n"
        "ours = [f for f in sys.meta_path if type(f).__module__.startswith('swbert')]\n"
        "print(sys.meta_path == finders, sys.path_hooks == hooks, ours == [])"
    )
    assert fresh(code) == ["True", "True", "True"]


@pytest.mark.slow
def test_deepspeed_through_startup_imports_no_mlflow_and_leaves_it_importable():
    code = (
        "import sys\n"
        "from swbert._startup import import_deepspeed\n"
        "ds = import_deepspeed()\n"
        "print(ds is sys.modules['deepspeed'], 'mlflow' in sys.modules,\n"
        "      sys.modules['deepspeed.autotuning.autotuner'].has_mlflow)\n"
        "import mlflow\n"  # the import system as it was: swbert's own tracking still imports it
        "print(mlflow.__name__, import_deepspeed() is ds)"
    )
    assert fresh(code) == ["True", "False", "False", "mlflow", "True"]
