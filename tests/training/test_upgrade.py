"""`python -m swbert.upgrade` on the stored run an older swbert wrote (tests/assets/old_runs/): every
old form in it is refused where it is met, in one line naming the command; the command rewrites it
once, keeping the original; the upgraded checkpoint resumes with today's trainer. And the old
spellings of a switch and of the fault variables: accepted as documented, or refused naming today's."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from swbert.runtime.checkpoint_format import (
    OutdatedCheckpoint,
    file_hash,
    is_complete,
    is_universal,
    marker_hashes,
    outdated,
)
from swbert.training import checkpoint as ckpt
from swbert.training.resume import find_checkpoint
from swbert.upgrade import PRE_UPGRADE, main
from tests.launch_utils import read_metrics, run_single

FIXTURE = Path(__file__).parents[1] / "assets" / "old_runs" / "format1_prefusion.tar.xz"
TAG = "step_00000004"
UPGRADED = "upgraded: RNG files: NumPy arrays -> tensors; tokenizer: "


def extract(dest: Path) -> tuple[Path, Path]:
    """(run folder, data folder) of the stored run, unpacked under `dest`."""
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(dest, filter="data")
    return dest / "run", dest / "data" / "data"


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): file_hash(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_old_form_is_refused_in_one_line_naming_the_upgrade(tmp_path):
    """Resume (auto, a checkpoints/ folder, a step folder), conversion and the export's tokenizer
    refuse the old checkpoint, naming the command; nothing reads it as it is."""
    from swbert.parallel.convert import to_hf, to_universal
    from swbert.runtime.run_tokenizer import tokenizer_for_export

    run, _ = extract(tmp_path)
    root = run / "checkpoints"
    found = outdated(root / TAG)
    assert len(found) == 4, found
    assert [f.split(",")[0].split(" (")[0] for f in found] == [
        "checkpoint format 1",
        "the tokenizer named by an absolute path",
        "RNG files holding NumPy arrays",
        "the attention projections before their fusion",
    ]
    assert not is_complete(root / TAG)  # format 1 has no marker: only the upgrade writes one
    command = f"python -m swbert.upgrade {root}, then run this again"
    for resume in ("auto", str(root), str(root / TAG)):
        with pytest.raises(OutdatedCheckpoint) as err:
            find_checkpoint(resume, root)
        assert "\n" not in str(err.value) and str(err.value).endswith(command), err.value
    for convert in (lambda: to_hf(root, tmp_path / "hf"), lambda: to_universal(root, tmp_path / "u")):
        with pytest.raises(OutdatedCheckpoint, match=command):
            convert()
    meta = json.loads((root / TAG / ckpt.META).read_text())
    with pytest.raises(OutdatedCheckpoint, match=command):
        tokenizer_for_export(root / TAG, meta)
    cut = root / "step_00000006"  # an old save cut off before its meta file: set aside, not upgraded
    cut.mkdir()
    shutil.copy(root / TAG / "rng_rank00000.pt", cut)
    assert outdated(cut) == []


def test_the_upgrade_rewrites_each_form_once_and_keeps_the_original(tmp_path, capsys):
    """A dry run writes nothing; the upgrade rewrites the step folder (hashes recorded, weights
    equal to the original's with the projections packed, RNG files that load with no NumPy type
    allowed, the tokenizer kept in the run) and keeps the original byte for byte; a second run says
    there is nothing to do and changes nothing."""
    from swbert.convert import fused_projections
    from swbert.models import SWBertConfig
    from swbert.parallel.convert import merged_state_dict
    from swbert.runtime.run_tokenizer import tokenizer_for_export
    from swbert.safe_load import load

    run, data = extract(tmp_path)
    root, before = run / "checkpoints", hashes(run)
    main([str(run), "--dry-run"])
    assert f"{root / TAG}: would change: checkpoint format 1" in capsys.readouterr().out
    assert hashes(run) == before
    main([str(run), "--tokenizer", str(data / "tokenizer")])
    out = capsys.readouterr().out
    assert f"{root / TAG}: {UPGRADED}" in out and "q_proj, k_proj, v_proj -> in_proj" in out
    assert "format 1 -> 2" in out

    tag_dir = root / TAG
    assert outdated(tag_dir) == [] and is_complete(tag_dir) and is_universal(tag_dir)
    recorded = marker_hashes(tag_dir)
    assert recorded and recorded == {k: v for k, v in hashes(tag_dir).items() if k != ckpt.COMPLETE}
    kept = root / PRE_UPGRADE / TAG
    assert hashes(kept) == {k[len(f"checkpoints/{TAG}/") :]: v for k, v in before.items() if TAG in k}

    meta = json.loads((tag_dir / ckpt.META).read_text())
    config = SWBertConfig.from_dict(meta["model_config"])
    original = load(kept / "mp_rank_00_model_states.pt", map_location="cpu")["module"]
    packed = fused_projections(dict(original), config)
    merged = merged_state_dict(tag_dir, config)
    assert merged.keys() == {k for k, v in packed.items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(merged[k], packed[k].float()) for k in merged)
    assert load(tag_dir / "mp_rank_00_model_states.pt")["skipped_total"] == 0  # kept since format 2
    ckpt.set_rng_state(ckpt.load_rng_state(tag_dir / "rng_rank00000.pt"))
    assert meta["tokenizer_dir"] == "tokenizer" and meta["checkpoint_format"] == 2
    assert tokenizer_for_export(tag_dir, meta) == (run / "tokenizer").resolve()

    upgraded = hashes(run)
    main([str(root)])
    assert capsys.readouterr().out == f"{tag_dir}: today's format, nothing to do\n"
    assert hashes(run) == upgraded


@pytest.mark.slow
def test_an_old_checkpoint_given_to_resume_fails_in_one_line_and_resumes_once_upgraded(tmp_path):
    """Given straight to --resume, the old checkpoint stops the job with status 2 and one line naming
    the command (no traceback, nothing started); upgraded, today's trainer resumes it at its step."""
    run, data = extract(tmp_path)
    args = [
        "--config", "tiny_cpu", "--size", "1x64", "--attention-type", "standard",
        "--pad-vocab-multiple", "1",  # the stored run predates vocabulary padding
        "--data-dir", str(data), "--output-dir", str(run), "--mlflow", "false", "--export", "false",
        "--train-steps", "6", "--save-interval", "2", "--eval-interval", "1000", "--log-interval", "1",
    ]  # fmt: skip
    refused = run_single([*args, "--resume", str(run / "checkpoints" / TAG)])
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(
        f"python -m swbert.upgrade {run / 'checkpoints'}, then run this again"
    ), refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert not (run / "checkpoints" / "incomplete").exists()  # not taken for a cut-off save

    main([str(run), "--tokenizer", str(data / "tokenizer")])
    resumed = run_single([*args, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / TAG} at step 4" in resumed.stdout + resumed.stderr
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    # the trained weights were loaded: the loss goes on from where the stored run left it
    assert metrics[5]["loss"] < metrics[1]["loss"] - 0.1
    assert ckpt.is_complete(run / "checkpoints" / "step_00000006")


@pytest.mark.parametrize(
    ("value", "setting"),
    [("true", "on"), ("yes", "on"), ("1", "on"), (None, "on"), ("false", "off"), ("0", "off")],
)
def test_compile_takes_the_spellings_it_was_documented_with(value, setting, tmp_path):
    """`compile` was a boolean before it had `auto`: its spellings (and a bare --compile) still mean
    on and off, on the command line as in a recipe; another value is refused naming the choices."""
    from swbert.training.cli import parse_args

    assert parse_args(["--compile", *([value] if value else [])]).compile == setting
    if value is not None:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"compile: {value}\n")
        assert parse_args(["--config", str(recipe)]).compile == setting
    assert parse_args(["--no-compile"]).compile == "off"
    with pytest.raises(ValueError, match="compile='maybe' is not one of auto, on, off"):
        parse_args(["--compile", "maybe"])


def test_the_fault_variables_of_the_first_drills_are_refused_naming_todays(monkeypatch):
    """A drill that set one would otherwise run without its kill."""
    from swbert.training.faults import kill_requested

    monkeypatch.setenv("SWBERT_FAULT_KILL_AFTER_STEP", "14")
    with pytest.raises(ValueError, match="SWBERT_FAULT_KILL_AFTER_STEP is no longer read: set "):
        kill_requested("after_step", 14, 0)
    monkeypatch.delenv("SWBERT_FAULT_KILL_AFTER_STEP")
    monkeypatch.setenv("SWBERT_FAULT_KILL_IN_SAVE", "8")
    with pytest.raises(ValueError, match="SWBERT_FAULT_KILL=in_save:8 instead"):
        kill_requested("in_save", 8, 0)
