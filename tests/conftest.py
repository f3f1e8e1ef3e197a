"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _set_what_make_test_sets() -> None:
    """What the Makefile gives `make test`, for a bare `pytest` too, before anything imports
    DeepSpeed (which picks its accelerator once, and JIT-builds its ops under TORCH_EXTENSIONS_DIR):
    the ops built in this environment's own folder (the Makefile's, which every swbert job uses
    when the variable is unset: `swbert._startup.extensions_dir`), and DeepSpeed's CPU accelerator.
    Either, when set and not empty, is left as it is."""
    from swbert._startup import use_own_extensions_dir

    use_own_extensions_dir()
    if not os.environ.get("DS_ACCELERATOR"):
        os.environ["DS_ACCELERATOR"] = "cpu"


_set_what_make_test_sets()

from tests.launch_utils import HANG_S, make_data_dir, make_second_folder  # noqa: E402

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
    "test_pretrain_compiled.py", "test_gpu_window.py", "test_slurm.py", "test_launcher_faults.py",
    "test_pretrain.py",
    "test_checkpoint_safety.py", "test_pretrain_mlflow.py", "test_compile.py", "test_install.py",
    "test_scaling.py", "test_perf_optimisations.py", "test_multinode.py", "test_finetune_train.py",
    "test_integrity_run.py", "test_heartbeat.py", "test_fault_matrix.py", "test_cpu_kernels.py",
    "test_parallel_deepspeed.py", "test_data_preprocess.py", "test_parallel_pretrain.py",
    "test_static_shapes.py", "test_finetune_mlflow.py", "test_nonfinite.py", "test_host_syncs.py",
    "test_paper_figures.py", "test_integrity_checkpoint.py", "test_perf_benchmarks.py",
]  # fmt: skip


# Session fixtures that run the data_prep CLIs (seconds of CPU each, more on a loaded machine): a test
# that uses one is slow, whether or not its file says so.
SLOW_FIXTURES = {"data_dir", "mix_dirs"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """The tiers, then the order.

    A test that uses a fixture of `SLOW_FIXTURES` is marked slow, so `make test-fast` builds no data.
    Every slow or long test gets the one hang guard of a test that starts jobs (`HANG_S` as its
    pytest-timeout limit, unless it sets its own): far above the slowest case on a loaded machine,
    where pyproject's 900 s, ample for a unit test, could end a test of three launches still running.

    Then the longest files first (`LONGEST_FIRST`), the rest in their usual order: `make test` hands
    whole files to its 2 workers (`--dist loadfile`) in this order; starting with the longest files
    and ending with short ones keeps both workers busy to the end, instead of one worker running a
    long file alone after the other has finished (longest-first scheduling)."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        starts_jobs = item.get_closest_marker("slow") or item.get_closest_marker("long")
        if starts_jobs and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(HANG_S))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
