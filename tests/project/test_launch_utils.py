"""tests/launch_utils.py, the launcher of the multi-process tests: a rank runs with the DeepSpeed
accelerator its environment asks for, and the usual (CPU) rank is still forked from the server."""

from __future__ import annotations

import json

import pytest

from tests.launch_utils import job_env, launch

SCRIPT = "tests/scripts/which_accelerator.py"


def _accelerator_of(env: dict[str, str]) -> dict:
    result = launch(1, [], env=env, script=SCRIPT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_rank_gets_the_accelerator_its_environment_asks_for():
    """DS_ACCELERATOR=cuda gives DeepSpeed's CUDA accelerator (which it builds without a GPU too),
    not the CPU one the fork server chose when it imported DeepSpeed."""
    assert _accelerator_of(job_env(DS_ACCELERATOR="cuda")) == {
        "accelerator": "CUDA_Accelerator",
        "preloaded": False,  # a fresh interpreter
    }


@pytest.mark.slow
def test_a_cpu_rank_is_forked_from_the_server():
    """The default, the launcher of most tests: forked with DeepSpeed already imported."""
    assert _accelerator_of(job_env()) == {"accelerator": "CPU_Accelerator", "preloaded": True}


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow  # starts two ranks
def test_ranks_start_again_on_another_port_when_theirs_was_taken(monkeypatch):
    """Another process taking the free port before the rendezvous binds it (EADDRINUSE, seen with
    two workers launching jobs at once) is retried on a new port, not reported as the test's failure."""
    import socket

    from tests.parallel import test_parallel_harness as harness

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        given = [held.getsockname()[1]]  # the first port handed out is taken
        real = harness._free_port
        monkeypatch.setattr(harness, "_free_port", lambda: given.pop() if given else real())
        harness.run_ranks(_barrier, 2)
        assert not given
