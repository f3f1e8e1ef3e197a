"""benchmarks/checkpoint_hash.py runs against the checkpoint code as it is (it stubs the hashing out
of a real save for its side-by-side figure, so a renamed hook would break it silently)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.launch_utils import REPO, job_env


@pytest.mark.slow  # two ranks save and load a tiny model once
def test_checkpoint_hash_benchmark_smoke():
    done = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_hash.py", "--size", "tiny", "--vocab", "128", "--reps", "1"],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m[0]: float(m[1]) for m in re.findall(r"^(save|start-up)\s+([0-9.]+)\s", done.stdout, re.M)}
    assert set(rows) == {"save", "start-up"} and all(v > 0 for v in rows.values()), done.stdout
