"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.launch_utils import make_data_dir

# The environment's own tools first, as in an activated environment (CI does not activate it): the
# launched jobs need its torchrun/deepspeed, and ranks forked inside the test process JIT-build
# DeepSpeed's ops with whatever `ninja` is on PATH (a system one of another version, or none, would
# rebuild or fail to build the ops built with the environment's). Launched jobs inherit it.
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A tokenizer and shards built once per session by the real data_prep CLIs (about 15 s).

    Training only reads it, so every module's jobs share it."""
    return make_data_dir(tmp_path_factory.mktemp("tiny-data"))
