"""benchmarks/gpu_hour.py (`make test-gpu`) on a CPU: the step runner, the report, the readers of
each step's output, the commands' arguments against the parsers they reach, and one real step in
its smoke size, so that the script works the day a GPU runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks import gpu_hour
from benchmarks.gpu_hour import Context, Outcome, Step
from tests.launch_utils import REPO, job_env


@pytest.mark.slow
def test_without_cuda_it_says_so_in_one_line_and_exits_77():
    env = job_env(CUDA_VISIBLE_DEVICES="")  # no device, on a GPU machine too
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_hour.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == gpu_hour.SKIPPED == 77
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("gpu_hour: skipped, no GPU to test: torch ")


def test_an_unknown_step_is_named_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_hour.main(["--only", "mfu,no_such_step"])
    assert exit_.value.code == 2
    assert (
        "--only: unknown step mfu, no_such_step; the steps are cuda_tests, zero3_compile"
        in capsys.readouterr().err
    )


def test_dry_run_lists_every_step_and_checks_the_commands_arguments(capsys, monkeypatch, tmp_path):
    assert gpu_hour.main(["--dry-run", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for step in gpu_hour.STEPS:
        assert step.name in out
    for command in ("tests/e2e/test_cuda.py", "launchers/pretrain.py", "ds_configs/zero3.json", "--compile on",
                    "train_step.py", "compile_overlap.py", "finetune_glue.py"):  # fmt: skip
        assert command in out, command
    assert "refused" not in out
    # a flag the pretraining CLI or the fine-tuning launcher no longer takes fails the dry run
    pretrain_args = gpu_hour._pretrain_args
    monkeypatch.setattr(gpu_hour, "_pretrain_args", lambda *a: [*pretrain_args(*a), "--no-such-key", "1"])
    finetune_cmd = gpu_hour._finetune_cmd
    monkeypatch.setattr(gpu_hour, "_finetune_cmd", lambda ctx: [*finetune_cmd(ctx), "--no-such-flag", "1"])
    assert gpu_hour.main(["--dry-run", "--work-dir", str(tmp_path)]) == 1
    refused = [line for line in capsys.readouterr().out.splitlines() if "refused" in line]
    assert len(refused) == 3, refused  # zero3_compile, host_syncs, finetune


def _sleeper(ctx: Context) -> Outcome:
    """A command that starts a grandchild and outlives the step's deadline."""
    grandchild = "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"
    ctx.run([sys.executable, "-c", grandchild])
    return Outcome("pass", "never reached")


def _broken(ctx: Context) -> Outcome:
    raise ValueError("no such file: runs/x.json\nsecond line")


@pytest.mark.slow
def test_every_step_runs_and_reports_whatever_the_ones_before_it_did(tmp_path):
    def ok(ctx: Context) -> Outcome:
        rc, out = ctx.run([sys.executable, "-c", "print('hello')"])
        return Outcome("pass" if rc == 0 and "hello" in out else "FAIL", "printed | hello")

    steps = [
        Step("slow", "a step past its timeout", 2, _sleeper),
        Step("broken", "a step that raises", 10, _broken),
        Step("absent", "a step with nothing to run here", 10, lambda ctx: Outcome("n/a", "not available")),
        Step("ok", "a passing step", 10, ok),
    ]
    ctx = Context(work=tmp_path / "work", smoke=True)
    before = {p.pid for p in psutil.process_iter()}
    start = time.monotonic()
    rows = gpu_hour.run_steps(steps, ctx)
    assert time.monotonic() - start < 30
    results = {step.name: outcome for step, outcome in rows}
    assert results["slow"].result == "timeout" and results["slow"].figure.startswith("after 2 s")
    assert results["broken"] == Outcome("FAIL", "ValueError: no such file: runs/x.json")
    assert results["absent"].result == "n/a" and results["ok"] == Outcome("pass", "printed | hello")
    time.sleep(0.5)
    leftover = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in before and p.info["cmdline"] == ["sleep", "120"]
    ]
    assert not leftover, "the timed-out step's grandchild survived"  # fmt: skip
    assert (
        "$ " in (ctx.work / "ok.log").read_text()
        and "# broken: FAIL" in (ctx.work / "broken.log").read_text()
    )

    text = gpu_hour.report(rows, "GPU hour: test", "runs/gpu-hour")
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[:2] == ["| check | result | figure |", "|---|---|---|"] and len(table) == 2 + len(steps)
    assert "| a passing step | pass | printed \\| hello |" in table  # a | in a figure is escaped
    assert gpu_hour.exit_status(rows) == 1
    assert gpu_hour.exit_status([row for row in rows if row[0].name in ("absent", "ok")]) == 0


def test_the_readers_of_each_steps_output():
    assert gpu_hour.pytest_counts("....\n=== 9 passed, 2 skipped, 1 warning in 40.1s ===\n") == {
        "passed": 9,
        "skipped": 2,
    }
    falling = {s: {"loss": 5.0 - 0.1 * s} for s in range(1, 21)}
    assert gpu_hour.loss_falls(falling, 20, 2) == Outcome("pass", "2 ranks, 20 steps: loss 4.80 -> 3.10")
    assert gpu_hour.loss_falls({s: {"loss": 4.0} for s in range(1, 21)}, 20, 1).result == "FAIL"
    assert gpu_hour.loss_falls(falling, 30, 1) == Outcome("FAIL", "20 of 30 steps logged")

    fp32 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    assert gpu_hour.grad_accum_of(fp32).result == "pass"
    assert gpu_hour.grad_accum_of({"bf16": {"enabled": True}}) == Outcome(
        "FAIL", "bf16.enabled=True, data_types.grad_accum_dtype=unset (accumulates in bf16)"
    )

    overlap = {"eager": 0.035, "per_block": 0.053, "whole_model": 0.829}
    assert gpu_hour.overlap_of({k: {"first_reduce_fraction": v} for k, v in overlap.items()}) == Outcome(
        "pass", "eager 3.5%, per block 5.3%, whole model 82.9% of the backward (CPU, gloo)"
    )
    late = {"per_block": {"first_reduce_fraction": 0.9}, "whole_model": {"first_reduce_fraction": 0.9}}
    assert gpu_hour.overlap_of(late).result == "FAIL"

    models = {
        name: {"tflops": tflops} for name, tflops in zip(gpu_hour.VARIANTS, (494.5, 445.0, 470.0, 475.0))
    }
    train_step = {"machine": "NVIDIA H100 80GB HBM3", "args": {"device": "cuda"}, "models": models,
                  "ratios": {"shared/standard": 1.08}}  # fmt: skip
    assert gpu_hour.mfu_of(train_step) == Outcome(
        "pass", "standard 50.0%, shared 45.0%, symmetric 47.5%, pairwise 48.0%; shared/standard 1.08x"
    )

    call = {"stack": []}
    calls = [{"kind": "item", **call}, {"kind": "cuda_stream_sync", **call}]
    per_step = {str(s): calls * (2 if s == 1 else 1) for s in range(1, 6)}  # the first: the warm-up
    assert gpu_hour.syncs_per_step(per_step) == Outcome(
        "pass", "1 CUDA synchronisations per step (1 host-blocking calls; median of steps 2-4)"
    )
    assert gpu_hour.syncs_per_step({"1": []}).result == "FAIL"


def test_the_sync_counter_adds_to_the_calls_the_counting_script_records(tmp_path, monkeypatch):
    """--count-syncs-child runs the counting script's main with the remaining arguments, after hooking
    CUDA's synchronisations into its `_record` (on a GPU; here the script's own calls only)."""
    script = tmp_path / "count.py"
    script.write_text(
        "import json, sys\ncalls = []\ndef _record(kind):\n    calls.append(kind)\n"
        "def main():\n    _record('item')\n"
        "    open(sys.argv[1], 'w').write(json.dumps([sys.argv[0], calls]))\n"
    )
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    out = tmp_path / "out.json"
    assert gpu_hour.main(["--count-syncs-child", str(script), str(out)]) == 0
    assert out.read_text() == f'["{script}", ["item"]]'


@pytest.mark.slow
def test_a_smoke_run_of_a_real_step_writes_the_report(tmp_path, capsys):
    report = tmp_path / "report.md"
    status = gpu_hour.main(
        ["--smoke", "--only", "mfu_eager", "--work-dir", str(tmp_path), "--report", str(report)]
    )
    assert status == 0, capsys.readouterr().out
    text = report.read_text()
    assert text.startswith("### GPU hour, smoke run on CPU")
    row = next(line for line in text.splitlines() if line.startswith("| MFU per variant, eager"))
    assert "| pass |" in row and all(f"{variant} " in row for variant in gpu_hour.VARIANTS), row
    assert (tmp_path / "mfu_eager.log").exists() and os.path.getsize(tmp_path / "train_step.json") > 0
