"""Preprocessing shared by tasks (`--num-tasks N --task-index I`): the shards and manifest of a single
run, a killed task that is re-run finishes the folder, and the flags are checked before any work."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from data_prep import preprocess as preprocess_cli
from data_prep.outdir import OutputLock, task_lock_name
from data_prep.preprocess import preprocess
from data_prep.sources import InputError
from data_prep.train_tokenizer import train_tokenizer
from data_prep.verify import verify_dir
from tests.launch_utils import HANG_S, _rank_context, write_corpus

ARGS = {"workers": 1, "shard_bytes": 8 << 10, "valid_fraction": 0.1, "progress": False}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """About 200 kB of generated text (24 shards of 8 KiB), its tokenizer and a single run's folder."""
    root = tmp_path_factory.mktemp("tasks")
    text = write_corpus(root / "corpus.txt", documents=600)
    train_tokenizer([str(text)], root / "tok", vocab_size=96, threads=1)
    preprocess([str(text)], root / "tok", root / "single", **ARGS)
    return {"root": root, "inputs": [str(text)], "tok": root / "tok", "single": root / "single"}


def _run_task(argv: list[str], log: str) -> None:
    """A task's process: its own session (killed as a group, as a scheduler does), its log in a file."""
    os.setsid()
    stream = open(log, "w", buffering=1)  # noqa: SIM115 (the process ends with the task)
    os.dup2(stream.fileno(), 2)
    handler = logging.StreamHandler(stream)
    logging.getLogger("data_prep").addHandler(handler)
    logging.getLogger("data_prep").setLevel(logging.INFO)
    sys.exit(preprocess_cli.main(argv))


def _task(corpus: dict, out: Path, index: int) -> multiprocessing.Process:
    """Task `index` of 2 as a process forked from the tests' fork server (torch already imported
    there: a second interpreter would spend seconds importing it through swbert; never forked from
    this process, which may have run a process group: tests/parallel/test_parallel_harness.py says why)."""
    argv = ["--input", *corpus["inputs"], "--tokenizer", str(corpus["tok"]), "--output", str(out),
            "--workers", "1", "--shard-size", "8K", "--valid-fraction", "0.1", "--no-progress",
            "--num-tasks", "2", "--task-index", str(index)]  # fmt: skip
    process = _rank_context().Process(target=_run_task, args=(argv, f"{out}-{index}.log"))
    process.start()
    return process


@pytest.mark.slow  # two task processes, one killed
def test_two_tasks_give_the_single_run_folder_and_a_killed_task_rerun_finishes_it(corpus, tmp_path):
    """Two task processes on one folder; task 0 is killed (-9, with its worker) after a shard.
    Task 1 finishes its half and leaves the manifest; task 0 re-run writes the rest, checks task 1's
    shards and writes the manifest: byte for byte the single run's (shard sha256s included)."""
    out = tmp_path / "two"
    single = json.loads((corpus["single"] / "manifest.json").read_text())
    total = len(single["shards"])
    assert total >= 12  # enough shards that the kill lands mid-task
    first, second = _task(corpus, out, 0), _task(corpus, out, 1)
    deadline = time.monotonic() + HANG_S
    while not (out / "shard_00000.json").exists():
        assert first.exitcode is None, Path(f"{out}-0.log").read_text()
        assert time.monotonic() < deadline, "task 0 never finished a shard"
        time.sleep(0.005)
    os.killpg(first.pid, signal.SIGKILL)  # the task and its worker
    first.join()
    second.join(timeout=HANG_S)
    assert second.exitcode == 0, Path(f"{out}-1.log").read_text()
    # task 1 says what task 0 was doing when it finished its own half: still running (it finished
    # first) or not running (killed by then); which one depends on the machine's load
    said = Path(f"{out}-1.log").read_text()
    assert "task 0 is running and still writing" in said or "task 0 (--task-index 0) is not running" in said
    assert not (out / "manifest.json").exists()
    written = {int(p.name[6:11]) for p in out.glob("shard_*.json")}
    assert {i for i in range(total) if i % 2} <= written  # task 1's half, all of it
    finished_by_0 = {i for i in written if i % 2 == 0}
    assert 1 <= len(finished_by_0) < total // 2, "the kill came too late to test anything"

    with pytest.raises(InputError, match=r"^--num-tasks 3: .* is being written by 2 task\(s\)"):
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=3, task_index=2)
    result = preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=0)
    assert result.shards_reused == len(finished_by_0)
    assert result.shards_written == total // 2 + total % 2 - len(finished_by_0)
    assert (out / "manifest.json").read_text() == (corpus["single"] / "manifest.json").read_text()
    assert not list(out.glob(".shard_*"))  # the killed worker's half-written files are gone
    assert verify_dir(out)[0] == []


def test_finishing_task_rewrites_a_shard_that_no_longer_matches_its_record(corpus, tmp_path):
    """A shard of the other task damaged with its size kept: the last task moves it aside (kept, never
    deleted), writes it again and the manifest is the single run's."""
    out = tmp_path / "damaged"
    assert (
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=1).manifest is None
    )
    victim = out / "shard_00001.train.bin"
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    victim.write_bytes(bytes(data))
    result = preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=0)
    assert result.manifest == json.loads((corpus["single"] / "manifest.json").read_text())
    assert [p.read_bytes() for p in (out / "rejected").glob("*/shard_00001.train.bin")] == [bytes(data)]
    assert verify_dir(out)[0] == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-tasks", "2", "--task-index", "2"], "--task-index 2 is outside 0..1 (--num-tasks 2)"),
        (["--task-index", "-1"], "--task-index -1 is outside 0..0 (--num-tasks 1)"),
        (["--num-tasks", "0"], "--num-tasks 0: must be at least 1"),
    ],
)
def test_task_flags_are_checked_before_any_work(flags, message, tmp_path, capsys) -> None:
    argv = ["--input", "gone.txt", "--tokenizer", "tok", "--output", str(tmp_path / "o"), *flags]
    with pytest.raises(SystemExit) as exit_info:
        preprocess_cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_overwrite_is_refused_while_a_task_writes_the_folder(corpus, tmp_path):
    """--overwrite deletes another plan's shards: never under a task that is still writing them."""
    out = tmp_path / "busy"
    preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=1)
    other = {**ARGS, "valid_fraction": 0.2}
    with OutputLock(out, task_lock_name(0)):  # task 0 at work
        with pytest.raises(
            InputError, match=r"^--overwrite: .* running preprocess \(.preprocess.task-0.lock"
        ):
            preprocess(corpus["inputs"], corpus["tok"], out, **other, overwrite=True)
    assert len(list(out.glob("shard_*.json"))) == 12  # nothing deleted
    assert preprocess(corpus["inputs"], corpus["tok"], out, **other, overwrite=True).manifest is not None
