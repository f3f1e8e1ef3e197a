"""Integrity, round two (issue #46): a marker that names no usable hash is damage, not a checkpoint
to load unchecked; the meta file is checked before it is read; hyper-parameters are finite. (The
export, the conversions and the resumed engine's clipping: tests/training/test_integrity_checkpoint.py,
which has a trained run.)"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from swbert.training import checkpoint as ckpt
from swbert.training.resume import CheckpointDamaged, Resume, resolve_resume
from tests.training.test_integrity_checkpoint import fake_checkpoint, flip_byte

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
RECORD = {"model": {"size": "mini"}}


def _checkpoint(root: Path, step: int) -> Path:
    """A fake step folder whose meta records a model, as the trainer's does."""
    tag_dir = fake_checkpoint(root, step, complete=False)
    ckpt.mark_complete(tag_dir, step, RECORD)
    return tag_dir


def _edit_marker(tag_dir: Path, **changes: object) -> None:
    marker = json.loads((tag_dir / ckpt.COMPLETE).read_text())
    for key, value in changes.items():
        if value is None:
            marker.pop(key, None)
        else:
            marker[key] = value
    (tag_dir / ckpt.COMPLETE).write_text(json.dumps(marker))


MARKERS = {
    "unknown hash": {"hash": "xxh3_129"},
    "no hash named": {"hash": None},
    "no hashes": {"hashes": None},
    "hashes not a mapping": {"hashes": ["0" * 32]},
    "a file without its hash": "drop-one",
}


@pytest.mark.parametrize("form", MARKERS, ids=list(MARKERS))
def test_a_marker_without_usable_hashes_makes_the_checkpoint_damaged(tmp_path, form):
    """Each used to make the whole checkpoint unverified: one optimizer byte flipped as well, and
    it was loaded."""
    tag_dir = _checkpoint(tmp_path, 8)
    flip_byte(tag_dir / OPTIM)
    if MARKERS[form] == "drop-one":
        hashes = json.loads((tag_dir / ckpt.COMPLETE).read_text())["hashes"]
        _edit_marker(tag_dir, hashes={k: v for k, v in hashes.items() if k != OPTIM})
    else:
        _edit_marker(tag_dir, **MARKERS[form])
    bad = ckpt.mismatched(tag_dir)
    assert bad and any(ckpt.COMPLETE in b for b in bad), bad
    assert all("\n" not in b for b in bad)


def test_an_unreadable_marker_is_damage_set_aside_in_damaged(tmp_path):
    """A marker is written atomically: one that does not parse was damaged at rest, not cut off."""
    root = tmp_path / "checkpoints"
    _checkpoint(root, 4)
    tag_dir = _checkpoint(root, 8)
    flip_byte(tag_dir / ckpt.COMPLETE, at=0)  # '{' -> ';': not JSON
    assert ckpt.mismatched(tag_dir) and not ckpt.is_complete(tag_dir)
    moved = ckpt.set_aside_incomplete(root)
    assert [p.parent.name for p in moved] == [ckpt.DAMAGED_DIR]
    assert (root / ckpt.DAMAGED_DIR / "step_00000008" / OPTIM).is_file()


def test_a_marker_of_the_pre_hash_format_resumes_unchecked_with_a_warning(tmp_path, caplog):
    tag_dir = _checkpoint(tmp_path, 8)
    _edit_marker(tag_dir, hash=None, hashes=None)  # {"step", "files"}: as saved before hashes
    with caplog.at_level(logging.WARNING):
        assert ckpt.mismatched(tag_dir) == []
    assert "before hashes were recorded" in caplog.text and str(tag_dir) in caplog.text


def test_a_file_the_marker_does_not_list_is_named(tmp_path):
    """Every file of a step is checked: DeepSpeed and zero_to_fp32 find shards by pattern."""
    tag_dir = _checkpoint(tmp_path, 8)
    shutil.copy(tag_dir / OPTIM, tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    bad = ckpt.mismatched(tag_dir)
    assert len(bad) == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in bad[0], bad


def _marker_damage_resume(tmp: str) -> None:
    import torch.distributed as dist

    from swbert.training.config import TrainConfig

    root = Path(tmp) / "checkpoints"
    assert resolve_resume(TrainConfig(resume="auto"), root, RECORD) == Resume(root, "step_00000004")
    dist.barrier()
    explicit = str(Path(tmp) / "explicit" / "step_00000008")
    with pytest.raises(CheckpointDamaged) as err:
        resolve_resume(TrainConfig(resume=explicit), root, RECORD)
    assert "\n" not in str(err.value) and "xxh3_129" in str(err.value) and "--resume auto" in str(err.value)


@pytest.mark.slow  # two ranks
def test_an_unknown_hash_with_a_flipped_byte_is_set_aside_or_refused(tmp_path):
    """Issue #46: "xxh3_128" changed to an unknown name and one optimizer byte flipped: --resume auto
    and an explicit --resume .../step_N both loaded it. Now auto sets it aside (kept whole) and
    resumes step 4; named explicitly, it is refused in one line naming the marker."""
    from tests.parallel.test_parallel_harness import run_ranks

    root = tmp_path / "checkpoints"
    _checkpoint(root, 4)
    tag_dir = _checkpoint(root, 8)
    flip_byte(tag_dir / OPTIM)
    _edit_marker(tag_dir, hash="xxh3_129")
    shutil.copytree(tag_dir, tmp_path / "explicit" / "step_00000008")
    run_ranks(_marker_damage_resume, 2, str(tmp_path))
    assert ckpt.checkpoint_tags(root) == ["step_00000004"]
    assert (root / ckpt.DAMAGED_DIR / "step_00000008" / OPTIM).is_file()


def test_a_damaged_meta_file_is_damage_not_another_model(tmp_path):
    """Issue #46: the meta file was read before the hashes were checked, so a flipped byte in it
    refused the run as "a different model" instead of setting the checkpoint aside. Before the
    process group, each rank now checks the meta file's hash before reading it: --resume auto looks
    past the damaged checkpoint (the collective check then moves it aside), and a step folder named
    explicitly is refused in one line naming the file."""
    from swbert.training.config import TrainConfig

    root = tmp_path / "checkpoints"
    _checkpoint(root, 4)
    tag_dir = _checkpoint(root, 8)
    meta = tag_dir / ckpt.META
    meta.write_bytes(meta.read_bytes().replace(b'"mini"', b'"mioi"'))  # same size, still JSON
    assert json.loads(meta.read_text())["model"]["size"] == "mioi"
    assert resolve_resume(TrainConfig(resume="auto"), root, RECORD) == Resume(root, "step_00000004")
    with pytest.raises(CheckpointDamaged) as err:
        resolve_resume(TrainConfig(resume=str(tag_dir)), root, RECORD)
    text = str(err.value)
    assert "\n" not in text and ckpt.META in text and "different model" not in text, text


NON_FINITE = [
    (["--lr", "inf"], "lr=inf must be a finite number"),
    (["--weight-decay", "inf"], "weight_decay=inf must be a finite number"),
    (["--adam-eps", "inf"], "adam_eps=inf must be a finite number"),
    (["--min-lr", "nan"], "min_lr=nan must be a finite number"),
    (["--grad-clip", "inf"], "grad_clip=inf must be a finite number"),
]


@pytest.mark.parametrize(("extra", "message"), NON_FINITE, ids=[e[0] for e, _ in NON_FINITE])
def test_a_non_finite_hyper_parameter_is_refused_in_one_line(extra, message, tmp_path, capsys):
    """Issue #46: --lr inf, --weight-decay inf and --adam-eps inf passed the checks."""
    from tests.e2e.test_pretrain import refused, tiny_args

    err = refused(tiny_args(tmp_path, tmp_path / "run", *extra), capsys)
    assert message in err and extra[0] in err and err.count("\n") == 1, err


def test_a_conversion_without_a_marker_of_its_own_is_upgraded_once(tmp_path):
    """Universal checkpoints converted before conversions recorded hashes are refused naming the
    upgrade, which writes their marker; then they are checked like any other."""
    from swbert.models import SWBertConfig
    from swbert.runtime.checkpoint_format import OutdatedCheckpoint, marker_hashes, outdated
    from swbert.training.resume import find_checkpoint
    from swbert.upgrade import upgrade

    tag_dir = tmp_path / "universal" / "step_00000004"
    (tag_dir / "zero" / "bert.x.weight").mkdir(parents=True)
    (tag_dir / "zero" / "bert.x.weight" / "fp32.pt").write_bytes(b"w" * 64)
    config = SWBertConfig.from_size("tiny", attention_type="shared", vocab_size=96)
    meta = {"model": {"attention_type": "shared"}, "model_config": config.to_dict(), "checkpoint_format": 2}
    (tag_dir / ckpt.META).write_text(json.dumps({**meta, "step": 4}))
    assert outdated(tag_dir) == [
        "a converted (universal) checkpoint without a completeness marker of its own"
    ]
    with pytest.raises(OutdatedCheckpoint, match="python -m swbert.upgrade"):
        find_checkpoint(str(tag_dir), tag_dir.parent)
    assert upgrade(tag_dir) == ["converted checkpoint: completeness marker written, with every file's hash"]
    assert outdated(tag_dir) == [] and ckpt.mismatched(tag_dir) == []
    assert "zero/bert.x.weight/fp32.pt" in marker_hashes(tag_dir)
    flip_byte(tag_dir / "zero" / "bert.x.weight" / "fp32.pt", at=3)
    assert ckpt.mismatched(tag_dir) == ["zero/bert.x.weight/fp32.pt"]
