"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.launch_utils import make_data_dir, make_second_folder

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


@pytest.fixture(scope="session")
def mix_dirs(data_dir, tmp_path_factory):
    """Two folders of one tokenizer for --data-mix: `data_dir` as `A`, and `B`, a smaller corpus of
    its own (about 4 s); linked under those names, which name each folder's metrics."""
    root = tmp_path_factory.mktemp("mix")
    second = make_second_folder(data_dir, root / "books")
    (root / "A").symlink_to(data_dir)
    (root / "B").symlink_to(second)
    return root / "A", root / "B"


# The files that take longest in `make test` (wall time, longest first, measured with a clean clone's
# empty inductor cache on 2 cores, as CI starts); `pytest_collection_modifyitems` starts with them. A
# file not listed runs after these.
LONGEST_FIRST = [
    "test_pretrain_compiled.py", "test_slurm.py", "test_launcher_faults.py", "test_pretrain.py",
    "test_checkpoint_safety.py", "test_pretrain_mlflow.py", "test_compile.py", "test_install.py",
    "test_scaling.py", "test_perf_optimisations.py", "test_multinode.py", "test_finetune_train.py",
    "test_integrity_run.py", "test_heartbeat.py", "test_fault_matrix.py", "test_cpu_kernels.py",
    "test_parallel_deepspeed.py", "test_data_preprocess.py", "test_parallel_pretrain.py",
    "test_static_shapes.py", "test_finetune_mlflow.py", "test_nonfinite.py", "test_host_syncs.py",
    "test_paper_figures.py", "test_integrity_checkpoint.py", "test_perf_benchmarks.py",
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The longest files first (`LONGEST_FIRST`), the rest in their usual order.

    `make test` hands whole files to its 2 workers (`--dist loadfile`) in this order: starting with
    the longest files and ending with short ones keeps both workers busy to the end, instead of one
    worker running a long file alone after the other has finished (longest-first scheduling)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
