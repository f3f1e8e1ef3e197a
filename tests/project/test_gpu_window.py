"""benchmarks/gpu_window.py (`make test-gpu`) on a CPU: the whole window rehearsed at tiny sizes with
no index and no virtual environment's scripts, so that it runs the day a GPU is lent; and what it
does with bad input (a wheel for another Python, no wheels, no GPU, a step past its timeout, a run
killed midway)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_window
from tests.launch_utils import REPO, wait_for

SCRIPT = [sys.executable, "benchmarks/gpu_window.py"]


def make_wheel(folder: Path, tag: str = "py3-none-any", name: str = "swbert_window_probe") -> Path:
    """A real wheel of a one-module package (what pip installs from the wheelhouse), made offline."""
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{name}-0.1.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{name}-0.1.dist-info/RECORD"] = "\n".join([*record, f"{name}-0.1.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def offline_env() -> dict[str, str]:
    """No package index (an address that refuses at once), and only the system's tools on PATH:
    the window must need neither an index nor the virtual environment's console scripts."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(PATH="/usr/bin:/bin", PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)
    return env


def rows_of(out: Path) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads((out / "gpu-window.json").read_text())["steps"]}


# The steps whose code paths no other CI test runs (the wheels, the window's data, its kernel probe,
# the profiled trainer step, the varlen check); the others repeat CI tests of their own (compiled
# ZeRO-3, TP compiled without graph breaks, the CUDA tests): the whole window is `make test-long`'s.
CI_STEPS = ("wheels", "data", "block_kernels", "trainer_shared", "varlen")


def rehearse(tmp_path: Path, *only: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    wheels = tmp_path / "wheels"
    make_wheel(wheels)
    out = tmp_path / "window"
    select = ["--only", ",".join(only)] if only else []
    done = subprocess.run([*SCRIPT, "--rehearse", "--wheels", str(wheels), "--out", str(out), *select], cwd=REPO,
                          env=offline_env(), capture_output=True, text=True, timeout=1800)  # fmt: skip
    return done, rows_of(out)


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(CI_STEPS, marks=pytest.mark.slow, id="steps-nothing-else-tests"),
        pytest.param(tuple(s.name for s in gpu_window.STEPS), marks=pytest.mark.long, id="every-step"),
    ],
)
def test_the_rehearsal_runs_its_steps_ok(tmp_path, steps):
    """CI rehearses CI_STEPS (about 1 minute alone, 100 s in the suite); `make test-long` every step
    (about 5 minutes in the suite)."""
    done, rows = rehearse(tmp_path, *steps)
    assert list(rows) == list(steps)
    failed = {name: (row["status"], row["note"]) for name, row in rows.items() if row["status"] != "ok"}
    assert not failed, f"{failed}\n{done.stdout[-3000:]}"
    assert done.returncode == 0
    assert rows["wheels"]["figures"]["installed"] == 1  # the probe wheel, through pip, offline
    assert rows["data"]["figures"]["train_tokens"] > 0
    assert rows["trainer_shared"]["figures"]["tokens_per_s"] > 0
    assert rows["trainer_shared"]["figures"]["host_blocking_calls"]["by_thread"]
    if "zero3_compile" in rows:
        assert rows["zero3_compile"]["figures"]["max_rel_loss_diff"] < 1e-3  # fp32-exact graphs on a CPU
        assert rows["tp2_graph_breaks"]["figures"]["graph_breaks"] == 0
    table = (tmp_path / "window" / "gpu-window.md").read_text()
    assert table.count("| ok |") == len(steps), table


def test_a_wheel_for_another_python_is_named_and_the_rest_installed(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels)
    other = "cp27-cp27mu-manylinux1_x86_64"
    make_wheel(wheels, tag=other, name="old_probe")
    row, use = gpu_window.install_wheels(wheels, tmp_path / "site", tmp_path / "wheels.log")
    assert row.status == "failed" and use
    assert row.note == f"not for Python {sys.version_info.major}.{sys.version_info.minor} on this platform: " \
                       f"old_probe-0.1-{other}.whl"  # fmt: skip
    assert (tmp_path / "site" / "swbert_window_probe" / "__init__.py").exists()
    assert not (tmp_path / "site" / "old_probe").exists()


def test_wheel_tags_are_matched_against_this_interpreter():
    tags = {"cp312-cp312-manylinux_2_17_x86_64", "py3-none-any", "cp312-abi3-manylinux_2_17_x86_64"}
    assert gpu_window.wheel_fits("megatron_core-0.16.1-cp312-cp312-manylinux_2_17_x86_64.whl", tags)
    assert gpu_window.wheel_fits(
        "x-1.0-cp38.cp312-abi3.none-manylinux_2_5_x86_64.manylinux_2_17_x86_64.whl", tags
    )
    assert gpu_window.wheel_fits("deepspeed-0.19.8-py3-none-any.whl", tags)
    assert not gpu_window.wheel_fits("msgpack-1.1.0-cp311-cp311-manylinux_2_17_x86_64.whl", tags)
    assert not gpu_window.wheel_fits("not-a-wheel.whl", tags)


@pytest.mark.slow
def test_without_wheels_or_a_gpu_each_row_says_why_and_the_rest_still_run(tmp_path):
    out = tmp_path / "window"
    done = subprocess.run([*SCRIPT, "--wheels", str(tmp_path / "none"), "--out", str(out),
                           "--only", "wheels,block_kernels,varlen"],
                          cwd=REPO, env={**offline_env(), "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 1
    rows = rows_of(out)
    assert rows["wheels"]["status"] == "failed"
    assert rows["wheels"]["note"].endswith("run `make gpu-wheels` where a package index is reachable")
    for name in ("block_kernels", "varlen"):
        assert rows[name]["status"] == "skipped"
        assert rows[name]["note"].startswith("no GPU: torch "), rows[name]


@pytest.mark.slow
def test_a_step_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    steps = {s.name: s for s in gpu_window.STEPS}
    window = gpu_window.Window(out=tmp_path, rehearse=True, budget=600)
    slow = dataclasses.replace(steps["data"], rehearse_timeout=0.5)  # the child needs seconds to start
    started = time.monotonic()
    rows = gpu_window.run_window(window, [slow, steps["data"]], tmp_path / "no-wheels")
    assert [r.status for r in rows] == ["timed out", "ok"], rows
    assert rows[0].note.startswith("killed after 0 s")
    assert rows_of(tmp_path)["data"]["status"] == "ok"
    assert time.monotonic() - started < 600


def test_a_step_that_the_budget_leaves_no_time_for_is_skipped(tmp_path):
    window = gpu_window.Window(out=tmp_path, rehearse=True, budget=1.0)
    rows = gpu_window.run_window(window, [gpu_window.STEPS[1]], tmp_path / "no-wheels")
    assert rows[0].status == "skipped" and rows[0].note.startswith("not started: 1 s of the 1 s budget left")


@pytest.mark.slow
def test_a_killed_window_keeps_the_rows_it_finished(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels)
    out = tmp_path / "window"
    proc = subprocess.Popen([*SCRIPT, "--rehearse", "--wheels", str(wheels), "--out", str(out),
                             "--only", "wheels,data,trainer_shared"], cwd=REPO, env=offline_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        wait_for(
            lambda: (out / "gpu-window.json").exists() and len(rows_of(out)) >= 1, timeout=600, proc=proc
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rows = rows_of(out)
    assert rows["wheels"]["status"] == "ok"
    assert "| wheels | ok |" in (out / "gpu-window.md").read_text()


def test_an_unknown_step_is_named_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_window.main(["--only", "trainer,varlen"])
    assert exit_.value.code == 2
    assert "unknown step trainer; the steps are wheels, data, block_kernels" in capsys.readouterr().err
