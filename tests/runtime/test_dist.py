"""The process group's start-up on CPU (swbert.runtime.dist), with real ranks on gloo."""

from __future__ import annotations

import pytest

from tests.launch_utils import job_env, launch


@pytest.mark.slow  # a 2-rank job
def test_a_cpu_job_leaves_no_shared_memory_buffer_behind_and_its_collective_works():
    """DeepSpeed's CPU collectives never unlink their 67 MB buffers: every job used to leave its own
    in /dev/shm until reboot."""
    result = launch(2, [], script="tests/scripts/shm_buffers.py", env=job_env(LOCAL_SIZE="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: named 0 sum [3.0, 3.0, 3.0, 3.0]" in result.stdout, result.stdout
