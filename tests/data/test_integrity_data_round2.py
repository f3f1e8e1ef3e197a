"""Integrity, round two (issue #46): the shard-hash cache sees in-place edits, a stopped loader worker
is named, a task killed while repairing finishes the folder on re-run, record names stay inside their
folder, a full disk and a file system without locks end in one message that says what to do."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from data_prep import default_corpus, outdir, preprocess as preprocess_module, shard_writer
from data_prep.outdir import OutputLock
from data_prep.preprocess import preprocess
from data_prep.sources import InputError
from data_prep.train_tokenizer import train_tokenizer
from data_prep.verify import verify_dir
from swbert.data.integrity import CACHE_NAME, ShardCorrupt, verify_shards
from swbert.data.manifest import read_manifest
from swbert.training.data import TrainingData
from tests.launch_utils import slowdown, write_corpus

ARGS = {"workers": 1, "shard_bytes": 8 << 10, "valid_fraction": 0.1, "progress": False}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """About 100 kB of generated text (a dozen 8 KiB shards), its tokenizer and a single run's folder."""
    root = tmp_path_factory.mktemp("round2")
    text = write_corpus(root / "corpus.txt", documents=300)
    train_tokenizer([str(text)], root / "tok", vocab_size=96, threads=1)
    preprocess([str(text)], root / "tok", root / "single", **ARGS)
    return {"inputs": [str(text)], "tok": root / "tok", "single": root / "single"}


def _one_line(message: str) -> str:
    assert message and "\n" not in message, message
    return message


# 1. the shard-hash cache ---------------------------------------------------------------------------


def test_an_in_place_edit_whose_mtime_was_put_back_is_hashed_again(corpus, tmp_path) -> None:
    """`touch -r`-style: same inode, size and mtime, other bytes; only ctime tells (the kernel sets it)."""
    data = tmp_path / "data"
    shutil.copytree(corpus["single"], data, ignore=shutil.ignore_patterns(CACHE_NAME))
    manifest, cache = read_manifest(data), data / CACHE_NAME
    assert verify_shards(data, manifest, cache).hashed > 0
    path = data / "shard_00000.train.bin"
    before = path.stat()
    time.sleep(0.05)  # ctime comes from a coarse clock (a few ms): let it move on
    with open(path, "r+b") as stream:  # edit in place: the inode stays
        stream.seek(before.st_size // 2)
        byte = stream.read(1)
        stream.seek(before.st_size // 2)
        stream.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # touch -r: the mtime put back
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    with pytest.raises(ShardCorrupt, match="sha256 differs"):
        verify_shards(data, manifest, cache)


# 2. a stopped loader worker -----------------------------------------------------------------------


@pytest.mark.slow  # a loader worker process, stopped: seconds
def test_a_stopped_loader_worker_is_named_within_the_timeout(corpus, monkeypatch) -> None:
    """A real DataLoader worker sent SIGSTOP: the rank's next batch raises, naming the worker's pid,
    that it is stopped, and what to do, instead of waiting for the collective timeout. The message
    names the 3 s setting that fired; the 60 s the loader gets (longer under load) only tell it from
    a wait on the stopped worker, which lasts until it is continued."""
    monkeypatch.setenv("SWBERT_LOADER_TIMEOUT_S", "3")
    data = TrainingData(corpus["single"], seq_len=32, mlm_probability=0.15, seed=0)
    loader = data.loader(0, 2, 0, 1, num_workers=1, prefetch_factor=1)
    next(loader)
    pid = loader._iterator._workers[0].pid  # torch's, private: the test's way to find the process
    outcome: dict = {}

    def drain() -> None:
        try:
            for _ in range(50):  # the batches it had ready, then the one it never builds
                next(loader)
        except Exception as err:  # noqa: BLE001 (the test inspects it)
            outcome["error"] = err

    os.kill(pid, signal.SIGSTOP)
    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        thread.join(timeout=60 * slowdown())
        assert not thread.is_alive(), "a stopped worker hung the loader"
    finally:
        os.kill(pid, signal.SIGCONT)  # a loader still waiting (before the fix) gets its batches
        thread.join(timeout=60)
        loader.close()
    error = outcome.get("error")
    assert error is not None
    message = _one_line(str(error))
    assert f"pid {pid}" in message and "stopped" in message, message
    assert "SWBERT_LOADER_TIMEOUT_S=3" in message and "--resume auto" in message, message


@pytest.mark.slow  # a loader worker process and this one stopped: seconds
def test_a_job_suspended_and_resumed_is_not_taken_for_a_stalled_worker(corpus, monkeypatch) -> None:
    """The worker, then the rank (this process) stopped for longer than the timeout and resumed, as
    `scontrol suspend` / `resume` do to a whole job: the batches come again, nothing is named. The
    rank waits on the stopped worker from the first stop to the second (0.5 s, and the helper's
    start-up: longer under load) before it is stopped itself: the timeout is 2 s on an idle machine,
    longer under load, and the stop three times it."""
    timeout = round(2 * slowdown())
    monkeypatch.setenv("SWBERT_LOADER_TIMEOUT_S", str(timeout))
    data = TrainingData(corpus["single"], seq_len=32, mlm_probability=0.15, seed=0)
    loader = data.loader(0, 2, 0, 1, num_workers=1, prefetch_factor=1)
    next(loader)
    worker = loader._iterator._workers[0].pid
    stop = 3 * timeout
    script = f"kill -STOP {worker}; sleep 0.5; kill -STOP {os.getpid()}; sleep {stop}; kill -CONT {worker} {os.getpid()}"
    helper = subprocess.Popen(["sh", "-c", script])
    try:
        for _ in range(20):  # waiting for the stopped worker when the rank itself is stopped
            next(loader)
    finally:
        helper.wait(timeout=60)
        os.kill(worker, signal.SIGCONT)
        loader.close()


def test_the_loader_timeout_setting_is_checked(corpus, monkeypatch) -> None:
    monkeypatch.setenv("SWBERT_LOADER_TIMEOUT_S", "soon")
    data = TrainingData(corpus["single"], seq_len=32, mlm_probability=0.15, seed=0)
    with pytest.raises(ValueError, match=r"^SWBERT_LOADER_TIMEOUT_S='soon' is not a number of seconds"):
        data.loader(0, 2, 0, 1, num_workers=1)


# 3. a task killed while repairing another task's shard ----------------------------------------------


def test_a_task_killed_while_repairing_finishes_the_folder_when_re_run(corpus, tmp_path, monkeypatch) -> None:
    out = tmp_path / "repair"
    single = json.loads((corpus["single"] / "manifest.json").read_text())
    assert (
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=1).manifest is None
    )
    victim = out / "shard_00001.train.bin"
    damaged = bytearray(victim.read_bytes())
    damaged[0] ^= 1
    victim.write_bytes(bytes(damaged))

    calls = []
    real_run_jobs = preprocess_module.run_jobs

    def killed_during_repair(jobs, *args, **kwargs):
        calls.append([job.name for job in jobs])
        if len(calls) == 2:  # the repair of task 1's shard: the task is killed (the shard was moved aside)
            raise KeyboardInterrupt
        return real_run_jobs(jobs, *args, **kwargs)

    monkeypatch.setattr(preprocess_module, "run_jobs", killed_during_repair)
    with pytest.raises(KeyboardInterrupt):
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=0)
    assert calls[1] == ["shard_00001"] and not victim.exists()
    monkeypatch.setattr(preprocess_module, "run_jobs", real_run_jobs)

    result = preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=0)
    assert result.manifest == single
    assert [p.read_bytes() for p in (out / "rejected").glob("*/shard_00001.train.bin")] == [bytes(damaged)]
    assert verify_dir(out)[0] == []


def test_a_task_that_cannot_finish_says_which_tasks_are_not_running(corpus, tmp_path, caplog) -> None:
    """Shards of a task that is not running (never started, or killed): the log names it and says
    to start it, rather than that other tasks still write."""
    out = tmp_path / "alone"
    with caplog.at_level("INFO", logger="data_prep"):
        assert (
            preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=0).manifest
            is None
        )
    text = caplog.text
    assert "still being written by other tasks" not in text, text
    assert "task 1 (--task-index 1) is not running: start it" in text, text


# 4. record names stay in their folder -------------------------------------------------------------


def test_a_record_naming_a_file_outside_the_folder_moves_nothing(corpus, tmp_path) -> None:
    out = tmp_path / "inside" / "out"
    assert (
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=1).manifest is None
    )
    outside = tmp_path / "inside" / "victim.train.bin"
    outside.write_bytes(b"someone else's file")
    record_path = out / "shard_00001.json"
    record = json.loads(record_path.read_text())
    record["name"] = "../victim"
    record_path.write_text(json.dumps(record))
    with pytest.raises(InputError) as err:
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS, num_tasks=2, task_index=0)
    message = _one_line(str(err.value))
    assert str(record_path) in message and "'../victim'" in message and "re-run" in message, message
    assert outside.read_bytes() == b"someone else's file"
    assert not (out / "rejected").exists() and not (out / "manifest.json").exists()
    assert record_path.is_file()  # kept, for the user to look at


@pytest.mark.parametrize("name", ["../victim", "/tmp/victim", "a/b", "..", "x\\..\\y"])
def test_shard_names_with_a_path_are_refused_where_files_are_moved(tmp_path, name) -> None:
    from data_prep.tasks import reject

    with pytest.raises(ValueError, match="not a shard name"):
        reject(tmp_path, name)


# 5. a full disk -----------------------------------------------------------------------------------


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_in_a_worker_is_one_message_and_the_run_resumes(corpus, tmp_path, monkeypatch) -> None:
    out = tmp_path / "full"
    written = []
    real_fsync = shard_writer.fsync_path

    def fills_up(path):  # the disk is full once two shards are written
        if len(written) >= 8:  # two splits x .bin/.idx per shard
            _enospc()
        written.append(path)
        real_fsync(path)

    monkeypatch.setattr(shard_writer, "fsync_path", fills_up)
    with pytest.raises(InputError) as err:
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS)
    message = _one_line(str(err.value))
    assert message.startswith(f"{out}: no space left on device"), message
    assert "shard_00002" in message and "2 finished shard(s) are kept" in message, message
    assert "re-run the same command to resume" in message, message
    monkeypatch.setattr(shard_writer, "fsync_path", real_fsync)  # space was freed
    result = preprocess(corpus["inputs"], corpus["tok"], out, **ARGS)
    assert result.shards_reused == 2
    assert (out / "manifest.json").read_text() == (corpus["single"] / "manifest.json").read_text()


def test_a_full_disk_at_the_manifest_is_one_message(corpus, tmp_path, monkeypatch) -> None:
    out = tmp_path / "full-manifest"
    real_write = preprocess_module.write_json_atomic

    def manifest_fails(path, payload):
        if Path(path).name == "manifest.json":
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real_write(path, payload)

    monkeypatch.setattr(preprocess_module, "write_json_atomic", manifest_fails)
    with pytest.raises(InputError) as err:
        preprocess(corpus["inputs"], corpus["tok"], out, **ARGS)
    message = _one_line(str(err.value))
    assert message.startswith(
        f"{out}: no space left on device (Disk quota exceeded) while writing manifest.json"
    )
    assert "finished shard(s) are kept" in message and "re-run the same command" in message, message


# 6. data locks on a file system without locks -----------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_is_named_with_the_way_out(tmp_path, monkeypatch, code) -> None:
    def no_locks(_fd, _operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(outdir.fcntl, "flock", no_locks)  # the module fcntl, as the lock calls it
    with pytest.raises(InputError) as err:
        with OutputLock(tmp_path):
            pass
    message = _one_line(str(err.value))
    assert message.startswith(f"--output {tmp_path}: its file system does not support file locks"), message
    assert os.strerror(code) in message and "SWBERT_DATA_LOCK=off" in message, message
    with pytest.raises(ValueError) as err:
        default_corpus.ensure_default_data(tmp_path / "default")
    message = _one_line(str(err.value))
    assert message.startswith(f"{tmp_path / 'default'}: its file system does not support file locks"), message

    monkeypatch.setenv("SWBERT_DATA_LOCK", "off")  # the way out, for who knows no other writer exists
    with OutputLock(tmp_path) as lock:
        assert lock.fd is None
    assert outdir.tasks_running(tmp_path) == []
