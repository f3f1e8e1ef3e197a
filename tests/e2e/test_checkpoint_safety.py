"""A run never loses work to a missing pointer or a cut-off save: completeness markers decide what a
checkpoint is, `latest` is only a convenience, and nothing but complete, older checkpoints is ever
deleted."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from swbert.safe_load import UnsafeCheckpointError
from swbert.training import checkpoint as ckpt, compat
from swbert.training.resume import agree_on_resume, find_checkpoint
from tests.launch_utils import (
    HANG_S,
    Forked,
    job_env,
    kill_group,
    launch,
    read_metrics,
    run_single,
    start,
    wait_for,
)


def fake_checkpoint(root, step: int, complete: bool = True):
    tag_dir = root / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * (100 + step))
    (tag_dir / "rng_rank00000.pt").write_bytes(b"r")
    if complete:
        ckpt.mark_complete(tag_dir, step, {"model": {}})
    return tag_dir


@pytest.mark.parametrize(
    "pointer", [None, "", "garbage\n", "../../elsewhere", "step_00000099", "step_00000004"]
)
def test_resume_trusts_the_markers_not_latest(tmp_path, pointer, caplog):
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        fake_checkpoint(root, step)
    if pointer is not None:
        (root / "latest").write_text(pointer)
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint("auto", root) == (root, "step_00000012")
    assert "resuming from the newest complete checkpoint, step_00000012" in caplog.text
    assert ckpt.set_aside_incomplete(root) == []  # nothing moved, nothing deleted
    assert ckpt.checkpoint_tags(root) == ["step_00000004", "step_00000008", "step_00000012"]


def test_cut_off_saves_are_moved_aside_never_deleted(tmp_path):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 4)
    fake_checkpoint(root, 8, complete=False)  # shards written, the job killed before its marker
    torn = fake_checkpoint(root, 12)
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"short")  # a file cut short after the marker
    assert ckpt.newest_complete(root) == "step_00000004"
    moved = ckpt.set_aside_incomplete(root)
    assert [p.name for p in moved] == ["step_00000008", "step_00000012"]
    assert all(p.parent == root / "incomplete" and (p / "rng_rank00000.pt").is_file() for p in moved)
    assert ckpt.checkpoint_tags(root) == ["step_00000004"]
    fake_checkpoint(root, 8, complete=False)  # cut off again: kept beside the first
    assert ckpt.set_aside_incomplete(root)[0].name == "step_00000008.1"


def test_prune_deletes_only_complete_older_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12, 16):
        fake_checkpoint(root, step)
    fake_checkpoint(root, 20, complete=False)
    ckpt.prune(root, keep=2)
    assert ckpt.checkpoint_tags(root) == ["step_00000012", "step_00000016", "step_00000020"]
    ckpt.prune(root, keep=0)  # the newest complete one always stays
    assert ckpt.checkpoint_tags(root) == ["step_00000016", "step_00000020"]


def test_checkpoints_saved_before_markers_are_refused_not_taken_for_cut_off(tmp_path):
    """Format 1 wrote the meta file after every rank's shards and had no marker: only a marker makes
    a checkpoint complete, and a format-1 one is refused naming the upgrade (a run would otherwise
    set it aside as cut off and start afresh)."""
    tag_dir = fake_checkpoint(tmp_path, 4, complete=False)
    (tag_dir / "swbert_meta.json").write_text(json.dumps({"model": {}}))
    assert not ckpt.is_complete(tag_dir)
    with pytest.raises(ValueError, match=f"checkpoint format 1.*python -m swbert.upgrade {tmp_path}"):
        find_checkpoint("auto", tmp_path)
    (tag_dir / "swbert_meta.json").write_text(json.dumps({"model": {}, "checkpoint_format": 2}))
    assert not ckpt.is_complete(tag_dir)  # format 2 without its marker: cut off
    assert find_checkpoint("auto", tmp_path) is None


@pytest.fixture(scope="module")
def interrupted(data_dir, tmp_path_factory) -> SimpleNamespace:
    """One single-process run serves two tests. It saves at 4, 8 and 12 and is killed (-9) at step
    14; while it trains (held stopped meanwhile) a second job on its folder is refused. Then
    `latest` goes missing and --resume auto continues the run: a new job takes over the folder of
    the killed one."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--train-steps", "16", "--save-interval", "4", "--keep-checkpoints", "4", "--log-interval", "1",
        "--eval-interval", "100", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
    ]  # fmt: skip
    killed = Forked(args, job_env(SWBERT_FAULT_KILL="after_step:14"), out.parent / "killed")
    try:
        # metrics.jsonl is made in set-up, with the lock held, seconds before the first step
        wait_for(lambda: (out / "metrics.jsonl").is_file(), proc=killed)
        killed.send_signal(signal.SIGSTOP)
        first_alive = killed.poll() is None
        second = run_single([*args, "--resume", "auto", "--train-steps", "2"])
        holder = json.loads((out / ".swbert.lock").read_text())
        killed.send_signal(signal.SIGCONT)
        killed.wait(timeout=HANG_S)
    finally:
        kill_group(killed)
    before = read_metrics(out)
    (out / "checkpoints" / "latest").unlink()
    resumed = run_single([*args, "--resume", "auto"])
    return SimpleNamespace(
        out=out, args=args, first_alive=first_alive, second=second,
        holder=holder, killed=killed, before=before, resumed=resumed,
    )  # fmt: skip


@pytest.mark.slow
def test_a_run_whose_latest_went_missing_continues_from_its_newest_checkpoint(interrupted):
    """The scenario that used to delete every checkpoint and train from step 0: checkpoints at 4, 8
    and 12, the job killed at step 14, `latest` gone. Resumed, it continues from step 12 with the
    losses it had logged, deletes nothing, and a finished run resumed again rewrites nothing."""
    out, args, before, resumed = interrupted.out, interrupted.args, interrupted.before, interrupted.resumed
    assert interrupted.killed.returncode != 0
    assert max(before) == 14
    root = out / "checkpoints"

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from the newest complete checkpoint, step_00000012" in resumed.stderr
    assert f"resumed from {root / 'step_00000012'} at step 12" in resumed.stdout
    after = read_metrics(out)
    for step in (13, 14):
        assert after[step]["loss"] == before[step]["loss"], step
    assert ckpt.checkpoint_tags(root) == [ckpt.tag_for(s) for s in (4, 8, 12, 16)]
    assert (root / "latest").read_text() == "step_00000016"

    final = root / "step_00000016"
    stamps = {p: p.stat().st_mtime_ns for p in final.rglob("*")}
    export_stamp = (out / "export" / "model.safetensors").stat().st_mtime_ns
    again = run_single([*args, "--resume", "auto"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in final.rglob("*")} == stamps  # not saved over
    assert (out / "export" / "model.safetensors").stat().st_mtime_ns == export_stamp
    assert "already holds step_00000016" in again.stderr


@pytest.mark.slow
def test_one_job_per_run_folder(interrupted):
    """A second job on a busy run folder exits at once naming the first; once the first is killed
    (-9), a new job takes the folder over (here the run above, resumed after its kill)."""
    second, out = interrupted.second, interrupted.out
    assert interrupted.first_alive, "the first job ended before the second one started"
    # "at once": the first job is stopped (SIGSTOP) holding the lock for as long as the second runs,
    # so a second job that waited for the lock would never return (run_single's timeout); and it is
    # refused before it builds a model. (No wall-clock bound: this machine's load is not the code's.)
    assert second.returncode != 0 and "model path:" not in second.stderr
    holder = interrupted.holder
    assert f"{out} is in use by another job" in second.stderr, second.stderr[-3000:]
    assert f'"pid": {holder["pid"]}' in second.stderr and holder["host"] in second.stderr
    assert holder["pid"] == interrupted.killed.pid
    assert interrupted.killed.returncode == -signal.SIGKILL
    third = interrupted.resumed
    assert third.returncode == 0, third.stderr[-3000:]
    assert "in use by another job" not in third.stderr


class _Payload:
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_rng_files_load_without_running_pickled_code(tmp_path):
    """RNG files are read with weights_only=True and no NumPy type allowed: the format (tensors)
    restores every stream; the earlier one (NumPy arrays, which `swbert.upgrade` rewrites) and a
    file that would run code on load are refused."""
    import random

    import megatron.core  # noqa: F401  (registers NumPy types as safe globals, as in every rank)
    import numpy as np
    import torch

    assert np.ndarray in torch.serialization.get_safe_globals()  # what the refusal must not trust

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(ckpt.rng_state(), tmp_path / "new.pt")
    earlier = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(earlier, tmp_path / "old.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.set_rng_state(ckpt.load_rng_state(tmp_path / "new.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    with pytest.raises(UnsafeCheckpointError, match=r"old\.pt: refused to load, it holds numpy"):
        ckpt.load_rng_state(tmp_path / "old.pt")
    torch.save({"python": _Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt: refused to load"):
        ckpt.load_rng_state(tmp_path / "evil.pt")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.long)])
def test_sigterm_under_torchrun_saves_and_the_run_resumes(sig, data_dir, tmp_path):
    """SLURM's time limit and torchrun's own shutdown send SIGTERM, Ctrl-C sends SIGINT; torchrun
    forwards either to the workers and kills them 30 s later. The workers finish their step, checkpoint and exit within
    that grace period, and --resume auto continues from the checkpoint. The signal goes as soon as
    metrics.jsonl exists, which rank 0 creates during set-up: the other rank may still be building
    its model, and a signal there is a pre-emption too, not a death by the default action."""
    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--save-interval", "1000", "--export", "false", "--log-interval", "1",
    ]  # fmt: skip
    log = tmp_path / "first.log"
    first = start(2, [*args, "--train-steps", "100000"], log=log)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file(), proc=first)
        os.kill(first.pid, sig)
        first.wait(timeout=HANG_S)  # torchrun's own 30 s grace is what must not end the ranks
    finally:
        kill_group(first)
    text = log.read_text()
    assert "pre-empted: checkpoint saved at step " in text, text[-3000:]
    assert ("Ctrl-C: checkpointing at the end of this step" in text) == (sig == signal.SIGINT)
    assert ("SIGTERM received: checkpointing at the end of this step" in text) == (sig == signal.SIGTERM)
    saved = int(text.split("pre-empted: checkpoint saved at step ")[1].split()[0])
    assert ckpt.newest_complete(out / "checkpoints") == ckpt.tag_for(saved)
    resumed = launch(2, [*args, "--resume", "auto", "--train-steps", str(saved + 2)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {saved}" in resumed.stdout and max(read_metrics(out)) == saved + 2


def test_a_second_ctrl_c_stops_at_once(capfd):
    """The first Ctrl-C asks for the checkpoint at the end of the step and says so; a second one
    interrupts at once. A SIGTERM after a Ctrl-C is the same stop, not a second Ctrl-C."""
    from swbert.training.config import TrainConfig
    from swbert.training.trainer import Trainer

    trainer = Trainer(TrainConfig())
    trainer._on_signal(signal.SIGINT, None)
    assert trainer.stop_signal == "SIGINT"
    assert "Ctrl-C again stops at once" in capfd.readouterr().err
    trainer._on_signal(signal.SIGTERM, None)
    assert trainer.stop_signal == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        trainer._on_signal(signal.SIGINT, None)
    other = Trainer(TrainConfig())
    other._on_signal(signal.SIGTERM, None)
    other._on_signal(signal.SIGINT, None)  # the first Ctrl-C: still a checkpoint
    assert other.stop_signal == "SIGTERM"


@pytest.mark.slow
def test_a_full_disk_fails_the_save_on_every_rank_and_the_run_resumes(data_dir, tmp_path):
    """Rank 1 cannot write its optimizer shard of the step-4 checkpoint (a file size limit: the
    kernel fails the write as a full disk does). Both ranks stop at once with an error naming the
    rank, the file, the folder and what to do, instead of rank 0 waiting in the save's barrier for
    the collective timeout; step 2 stays the newest complete checkpoint and --resume auto continues
    from it, the partial folder moved aside."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--train-steps", "4", "--save-interval", "2", "--export", "false", "--log-interval", "1",
    ]  # fmt: skip
    # the timeout bounds a regression (a rank left in a barrier) to a minute, and says so
    env = job_env(SWBERT_TEST_FSIZE="1:step_00000004.partial:100000", SWBERT_DIST_TIMEOUT_MIN="1")
    full = launch(2, args, env=env, script="tests/scripts/pretrain_fsize_limit.py")
    assert full.returncode != 0
    error = f"error: checkpoint step_00000004 could not be saved in {root}: rank 1 on "
    assert full.stderr.count(error) == 2, full.stderr[-5000:]  # from each rank
    line = next(x for x in full.stderr.splitlines() if x.startswith(error))
    assert "could not write zero_pp_rank_1_mp_rank_00_optim_states.pt" in line
    assert "file size limit (ulimit -f) 100000 bytes" in line and "Free space on the file system" in line
    assert "--resume auto continues from step_00000002, the newest complete checkpoint" in line
    assert "Timed out" not in full.stderr and "lost rank" not in full.stderr, full.stderr[-5000:]
    assert ckpt.newest_complete(root) == "step_00000002" and (root / "latest").read_text() == "step_00000002"
    assert (root / "step_00000004.partial").is_dir() and not (root / "step_00000004").exists()

    resumed = launch(2, [*args, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {root / 'step_00000002'} at step 2" in resumed.stdout
    assert (root / "incomplete" / "step_00000004" / "rng_rank00001.pt").is_file()
    assert ckpt.newest_complete(root) == "step_00000004" and max(read_metrics(out)) == 4


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_job_naming_it(data_dir, tmp_path):
    """kill -9 of one worker: the launcher ends the others at once (no 30-minute collective
    timeout) and its report names the dead rank."""
    import psutil

    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--save-interval", "1000", "--export", "false", "--log-interval", "1", "--train-steps", "100000",
    ]  # fmt: skip
    log = tmp_path / "job.log"
    job = start(2, args, log=log)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file(), proc=job)
        # the launcher's own children: a rank's DataLoader workers inherit its RANK but are not ranks
        workers = [p for p in psutil.Process(job.pid).children() if p.environ().get("RANK") == "1"]
        assert len(workers) == 1
        workers[0].kill()
        # ended by the launcher, not by the collective timeout (30 minutes): a third of it is ample
        # however loaded the machine
        job.wait(timeout=30 * 60 / 3)
        assert job.returncode != 0
    finally:
        kill_group(job)
    text = log.read_text()
    assert "rank      : 1" in text or "rank: 1" in text, text[-3000:]


@pytest.mark.slow  # preprocesses data or starts ranks
def test_a_flipped_bit_in_a_shard_names_the_shard_and_the_check(data_dir, tmp_path):
    """A bit flipped on disk after preprocessing (the size checks at open still pass) gives an error
    naming the shard and `data_prep.verify`, not an IndexError deep in the embedding."""
    import shutil

    from swbert.data import PackedSequences, open_corpus

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    shard = sorted(copy.rglob("*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[1] ^= 0x80  # bit 15 of the first token id (uint16): far outside a 96-piece vocabulary
    shard.write_bytes(bytes(raw))
    corpus = open_corpus(copy, "train")
    with pytest.raises(
        ValueError, match=rf"{shard.stem}\.bin holds token id .* outside the vocabulary of 96"
    ):
        samples = PackedSequences(corpus, 64)
        for i in range(len(samples)):
            samples[i]
    with pytest.raises(ValueError, match=f"python -m data_prep.verify {copy}"):
        corpus.document(0)


def _agree_on_resume(tmp: str) -> None:
    import torch.distributed as dist

    root, rank = Path(tmp), dist.get_rank()
    local = (root, "step_00000012") if rank == 0 else None  # rank 1 read a stale view: nothing to resume
    assert agree_on_resume(local) == (root, "step_00000012")
    with pytest.raises(
        RuntimeError, match=r"rank 1 on \S+ cannot see checkpoint .*step_00000012.*every node shares"
    ):
        agree_on_resume(local, visible=lambda path: rank != 1)  # a node without the shared folder
    assert agree_on_resume(None) is None


@pytest.mark.slow  # preprocesses data or starts ranks
def test_every_rank_resumes_what_rank_0_chose_or_all_fail_naming_the_blind_rank(tmp_path):
    """Rank 0 decides what to resume; a rank that cannot see that checkpoint (an output folder on a
    node-local disk) fails every rank at once with what to fix, instead of training from scratch."""
    from tests.parallel.test_parallel_harness import run_ranks

    (tmp_path / "step_00000012").mkdir()
    run_ranks(_agree_on_resume, 2, str(tmp_path))


def test_a_checkpoint_from_before_the_fused_projections_is_refused_with_the_upgrade_command(tmp_path):
    """ZeRO's flat optimizer buffers of such a checkpoint are in the old parameter order: resuming
    would scramble Adam's state. It is refused, naming `swbert.upgrade`; a checkpoint of another
    model is refused naming the flags; shared attention has nothing packed."""
    import torch

    from swbert.convert import separate_projections
    from swbert.models import SWBertConfig, SWBertForMaskedLM
    from swbert.runtime.checkpoint_format import OutdatedCheckpoint

    config = SWBertConfig.from_size("tiny", attention_type="standard", vocab_size=96)
    model = SWBertForMaskedLM(config)
    tag_dir = tmp_path / "checkpoints" / ckpt.tag_for(4)
    tag_dir.mkdir(parents=True)
    meta = {"model": {"attention_type": "standard"}, "model_config": config.to_dict(), "checkpoint_format": 2}
    (tag_dir / ckpt.META).write_text(json.dumps(meta))
    torch.save({"module": model.state_dict()}, tag_dir / "mp_rank_00_model_states.pt")
    ckpt.require_current(tag_dir)  # today's layout: fine
    compat.check_parameter_names(tag_dir, config.to_dict())
    torch.save({"module": separate_projections(model)}, tag_dir / "mp_rank_00_model_states.pt")
    upgrade = f"python -m swbert.upgrade {tag_dir.parent}, then"
    with pytest.raises(
        OutdatedCheckpoint, match=r"before their fusion \(q_proj, k_proj, v_proj\).*" + upgrade
    ):
        find_checkpoint(str(tag_dir), tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"attn\.k_proj\.bias.*another model's.*--size/--attention-type"):
        compat.check_parameter_names(tag_dir, config.to_dict())
    shared = SWBertConfig.from_size("tiny", attention_type="shared", vocab_size=96)
    torch.save({"module": SWBertForMaskedLM(shared).state_dict()}, tag_dir / "mp_rank_00_model_states.pt")
    (tag_dir / ckpt.META).write_text(json.dumps({**meta, "model": {"attention_type": "shared"}}))
    ckpt.require_current(tag_dir)
    compat.check_parameter_names(tag_dir, shared.to_dict())  # shared attention has nothing packed


@pytest.mark.parametrize(
    ("now", "message"),
    [
        ({"shared_bias": False}, r"shared_bias: checkpoint True vs this run False.*--shared-bias true"),
        (
            {"pad_vocab_multiple": 128},
            r"pad_vocab_multiple: checkpoint 1 vs this run 128.*--pad-vocab-multiple 1",
        ),
    ],
)
def test_a_checkpoint_of_another_model_form_is_refused_with_the_flag_to_resume_it(tmp_path, now, message):
    """Fields of the model config that the training config sets (and the model section of the record
    does not hold) are compared too; a checkpoint that predates a field has its old value (bs, no
    padding), so a run started before pretraining padded its vocabulary resumes with
    --pad-vocab-multiple 1 instead of failing on the table's shape."""
    tag_dir = fake_checkpoint(tmp_path, 4)
    with pytest.raises(ValueError, match=message):
        compat.check_compatible(tag_dir, {"model": {}, "model_config": now})
