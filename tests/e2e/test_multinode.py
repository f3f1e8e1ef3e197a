"""Two "nodes" on one machine: two per-node launchers with distinct node ranks meeting at a
127.0.0.1 rendezvous, through launchers/slurm/node_launch.sh (what each SLURM node runs)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from torch.testing import assert_close

from tests.golden import ASSETS
from tests.launch_utils import HANG_S, REPO, free_port, job_env, kill_group, read_metrics, slowdown

pytestmark = pytest.mark.slow

NODE_LAUNCH = str(REPO / "launchers" / "slurm" / "node_launch.sh")


def tiny(data_dir: Path, out: Path) -> list[str]:
    return [
        "launchers/pretrain.py", "--config", "tiny_cpu", "--data-dir", str(data_dir),
        "--output-dir", str(out), "--train-steps", "10", "--log-interval", "1", "--save-interval", "100",
        "--mlflow", "false", "--export", "false", "--cpu-kernels", "off",  # the model path a GPU runs
        # 8 sequences = 4 per rank x 2 ranks without accumulation: a run with another world size fails
        "--grad-accum-steps", "1",
    ]  # fmt: skip


def node(
    rank: int, nnodes: int, port: int, args: list[str], timeout: int = 600, **env: str
) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", NODE_LAUNCH, *args],
        cwd=REPO,
        env=job_env(
            NNODES=str(nnodes),
            NODE_RANK=str(rank),
            NPROC_PER_NODE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RDZV_ID="two-nodes",
            RDZV_TIMEOUT=str(timeout),
            **env,
        ),  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def single_process_losses() -> dict[int, float]:
    """The reference: the same recipe in one process (the golden file test_parallel_pretrain.py holds
    that run to). Two ranks read the same global batches as one, so only summation order differs."""
    losses = json.loads((ASSETS / "tiny_cpu-tp1-zero2-1rank.json").read_text())["loss"]
    return {int(step): loss for step, loss in losses.items()}


@pytest.mark.parametrize(
    "launcher, compile",
    [
        ("torchrun", "off"),
        pytest.param(
            "torchrun", "on", marks=pytest.mark.long
        ),  # CI compiles 2 ranks in test_pretrain_compiled
        pytest.param("deepspeed", "off", marks=pytest.mark.long),
    ],
)
def test_two_nodes_give_the_losses_of_one_process(launcher, compile, data_dir, tmp_path):
    """Two per-node launchers (torchrun's c10d rendezvous, or deepspeed --no_ssh with node ranks)
    train the model path a GPU runs, eager or compiled, to the single-process losses."""
    port = free_port()
    args = [*tiny(data_dir, tmp_path / "two-nodes"), "--compile", compile]
    two = [node(r, 2, port, args, SWBERT_LAUNCHER=launcher) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=HANG_S)[0] for p in two]
    finally:
        for p in two:
            kill_group(p)
    for proc, text in zip(two, outputs):
        assert proc.returncode == 0, text[-4000:]
    assert "model path: plain PyTorch ops, the path a GPU runs" in outputs[0]
    assert ("wrap 3/4: compiled per unit" in outputs[0]) == (compile == "on")
    assert (
        "node_launch: node 0/2" in outputs[0]
        and "node 1/2 on" in outputs[1]
        and f"({launcher})" in outputs[1]
    )
    two_nodes, reference = read_metrics(tmp_path / "two-nodes"), single_process_losses()
    assert sorted(two_nodes) == sorted(reference) == list(range(1, 11))
    # the same samples per step, so the same losses up to summation order (measured: under 1e-6
    # relative), and inductor's fusions when compiled
    rtol = 1e-4 if compile == "on" else 1e-5
    for step, loss in reference.items():
        assert_close(two_nodes[step]["loss"], loss, rtol=rtol, atol=1e-6)
    assert reference[10] != reference[1]


def test_unreachable_rendezvous_fails_within_the_timeout_naming_it(tmp_path):
    port = free_port()  # nothing listens there
    start = time.monotonic()
    proc = node(1, 2, port, ["launchers/pretrain.py", "--output-dir", str(tmp_path / "x")], timeout=5)
    output = proc.communicate(timeout=HANG_S)[0]
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert f"rendezvous 127.0.0.1:{port} not reachable after 5s" in output, output
    assert elapsed < 15 * slowdown(), elapsed  # the 5 s and bash's start-up (more under load)


def test_a_missing_node_fails_within_the_timeout_naming_the_rendezvous(data_dir, tmp_path):
    port = free_port()
    start = time.monotonic()
    proc = node(0, 2, port, tiny(data_dir, tmp_path / "alone"), timeout=10)
    try:
        output = proc.communicate(timeout=HANG_S)[0]
    finally:
        kill_group(proc)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert f"rendezvous 127.0.0.1:{port} (id two-nodes): not all 2 node(s) joined within" in output, output[
        -3000:
    ]
    assert "RDZV_TIMEOUT=10s" in output
    # the timeout plus interpreter start-up (60 s idle, more under load), never torchrun's own
    # 600 s join timeout: RDZV_TIMEOUT reached it
    assert elapsed < min(10 + 60 * slowdown(), 500), elapsed


def test_node_rank_outside_the_job_is_refused(tmp_path):
    proc = node(2, 2, free_port(), ["launchers/pretrain.py"])
    output = proc.communicate(timeout=HANG_S)[0]
    assert proc.returncode != 0 and "NODE_RANK=2 is outside 0..1 (NNODES=2)" in output
