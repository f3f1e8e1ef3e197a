"""What a run reads back is what it wrote, nothing in a checkpoint or export runs as code, and a
rewind is a branch: hashes in the completeness marker, checked before anything loads; every load
with weights_only=True; the newer line moved aside on a rewind, never overwritten or deleted."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import xxhash

from swbert.training import checkpoint as ckpt
from swbert.training.resume import CheckpointDamaged, Resume, find_checkpoint, resolve_resume
from tests.launch_utils import launch

# ---- hashes -----------------------------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    tag_dir = root / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(bytes(range(256)) * (4 + step))
    (tag_dir / "rng_rank00000.pt").write_bytes(b"r")
    if complete:
        ckpt.mark_complete(tag_dir, step, {"model": {}})
    return tag_dir


def flip_byte(path: Path, at: int = 100) -> None:
    """A same-size change: the sizes in the marker still match."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def test_the_marker_records_every_files_hash_and_a_same_size_flip_is_named(tmp_path):
    tag_dir = fake_checkpoint(tmp_path, 4)
    marker = json.loads((tag_dir / ckpt.COMPLETE).read_text())
    assert marker["hash"] == "xxh3_128" and set(marker["hashes"]) == set(marker["files"])
    assert ckpt.mismatched(tag_dir) == []
    flip_byte(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert ckpt.is_complete(tag_dir)  # sizes alone do not see it
    assert ckpt.mismatched(tag_dir) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    # the ranks split the reading: together they see it, once
    shares = [ckpt.mismatched(tag_dir, rank, 2) for rank in (0, 1)]
    assert sorted(shares[0] + shares[1]) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    # a universal (converted) folder is checked like any other: a marker copied from its source
    # (as conversions wrote before they recorded their own) names the source's files it lacks
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (tag_dir / "zero").mkdir()
    assert ckpt.mismatched(tag_dir) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def _verify_resume(tmp: str) -> None:
    import torch.distributed as dist

    from swbert.training.config import TrainConfig

    root = Path(tmp) / "checkpoints"
    record = {"model": {}}
    assert resolve_resume(TrainConfig(resume="auto"), root, record) == Resume(root, "step_00000004")
    dist.barrier()
    explicit = str(Path(tmp) / "explicit" / "step_00000008")
    with pytest.raises(CheckpointDamaged) as err:
        resolve_resume(TrainConfig(resume=explicit), root, record)
    assert "\n" not in str(err.value) and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in str(err.value)
    assert "--resume auto" in str(err.value)
    # a checkpoints/ folder whose only checkpoint is damaged: set aside, then nothing left to name;
    # rank 0's error is every rank's (the others used to wait for its choice until the timeout)
    lone = Path(tmp) / "lone"
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        resolve_resume(TrainConfig(resume=str(lone)), root, record)
    assert (lone / "damaged" / "step_00000008").is_dir()


@pytest.mark.slow  # trains and resumes
def test_a_damaged_checkpoint_falls_back_to_the_previous_one_and_is_kept_aside(tmp_path):
    """2 ranks on gloo share the reading; under --resume auto the damaged step 8 moves to damaged/
    (every file still there) and both ranks resume step 4; named explicitly, it is refused in one
    line naming the file, and left where it is."""
    from tests.parallel.test_parallel_harness import run_ranks

    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 4)
    flip_byte(fake_checkpoint(root, 8) / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    shutil.copytree(root / "step_00000008", tmp_path / "explicit" / "step_00000008")
    shutil.copytree(root / "step_00000008", tmp_path / "lone" / "step_00000008")
    run_ranks(_verify_resume, 2, str(tmp_path))
    assert ckpt.checkpoint_tags(root) == ["step_00000004"]
    assert (root / "damaged" / "step_00000008" / "rng_rank00000.pt").is_file()
    assert (tmp_path / "explicit" / "step_00000008" / ckpt.COMPLETE).is_file()


# ---- which checkpoint a resume names ----------------------------------------------------------


def test_the_folder_form_resumes_the_newest_complete_one_and_says_so(tmp_path, caplog):
    """`--resume RUN/checkpoints` with a stale `latest` does what --resume auto does: the newest
    complete checkpoint, with a warning; a damaged step named explicitly is a one-line error."""
    root = tmp_path / "checkpoints"
    for step in (4, 8):
        fake_checkpoint(root, step)
    (root / "latest").write_text("step_00000004")
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(str(root), root) == (root, "step_00000008")
    assert "names step_00000004; resuming from the newest complete checkpoint, step_00000008" in caplog.text
    cut = fake_checkpoint(root, 12)
    (cut / "rng_rank00000.pt").write_bytes(b"")  # cut short after its marker
    with pytest.raises(CheckpointDamaged) as err:
        find_checkpoint(str(cut), root)
    assert "\n" not in str(err.value) and f"resume from {root / 'step_00000008'}" in str(err.value)
    assert isinstance(err.value, ValueError)  # the launcher's one line, exit 2


# ---- a rewind is a branch ---------------------------------------------------------------------


def test_a_rewind_moves_the_newer_line_aside_and_pruning_keeps_the_rewind_point(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        fake_checkpoint(root, step)
    (root / "step_00000016.partial").mkdir()
    (root / "latest").write_text("step_00000012")
    folder = ckpt.abandon_newer(root, "step_00000004")
    assert folder is not None and folder.name.startswith("abandoned-")
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000008", "step_00000012", "step_00000016"]
    assert (
        ckpt.checkpoint_tags(root) == ["step_00000004"] and (root / "latest").read_text() == "step_00000004"
    )
    assert find_checkpoint("auto", root) == (root, "step_00000004")  # the rewound line
    fake_checkpoint(root, 6)
    ckpt.prune(root, keep=2)
    assert ckpt.checkpoint_tags(root) == ["step_00000004", "step_00000006"]
    assert ckpt.abandon_newer(root, "step_00000006") is None  # nothing newer: nothing moved


def test_a_save_never_writes_into_an_existing_step_folder(tmp_path):
    """The finished `.partial` folder is renamed into place; one already there is moved aside."""
    root = tmp_path / "checkpoints"
    old = fake_checkpoint(root, 8)
    stamp = (old / ckpt.COMPLETE).read_text()
    partial = root / "step_00000008.partial"
    partial.mkdir()
    (partial / "rng_rank00000.pt").write_bytes(b"new")
    ckpt.mark_complete(partial, 8, {"model": {}})
    ckpt._into_place(root, partial, "step_00000008")
    assert (root / "step_00000008" / "rng_rank00000.pt").read_bytes() == b"new"
    (kept,) = root.glob("abandoned-*/step_00000008")
    assert (kept / ckpt.COMPLETE).read_text() == stamp
    (root / "step_00000012.partial").mkdir()  # a save cut off before its rename
    assert [p.name for p in ckpt.set_aside_incomplete(root)] == ["step_00000012"]


# ---- end to end: a real run, its checkpoints and export ---------------------------------------


def _args(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--train-steps", "4", "--save-interval", "2", "--keep-checkpoints", "3", "--log-interval", "1",
        "--eval-interval", "100", "--hidden-dropout", "0.1", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    """A finished 2-rank run (ZeRO-2): checkpoints at steps 2 and 4, and its export."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    result = launch(2, _args(data_dir, out))
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".swbert.lock"))
    return copy


class _Payload:
    """What an attacker plants: unpickling it creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant(path: Path, marker: Path) -> None:
    """Replace a checkpoint file by a crafted pickle, the marker's hash updated as an attacker would."""
    torch.save({"module": _Payload(marker), "optimizer_state_dict": _Payload(marker)}, path)
    for tag_dir in (p for p in path.parents if (p / ckpt.COMPLETE).is_file()):
        marker_file = json.loads((tag_dir / ckpt.COMPLETE).read_text())
        name = str(path.relative_to(tag_dir))
        marker_file["files"][name] = path.stat().st_size
        if "hashes" in marker_file:
            marker_file["hashes"][name] = xxhash.xxh3_128(path.read_bytes()).hexdigest()
        (tag_dir / ckpt.COMPLETE).write_text(json.dumps(marker_file))


def _one_line_naming(text: str, path: Path) -> None:
    lines = [x for x in text.splitlines() if x.startswith("error: ")]
    assert lines and f"{path}: refused to load" in lines[0], text[-3000:]


@pytest.mark.slow
def test_planted_pickles_never_run(trained, data_dir, tmp_path, capsys):
    """A crafted pickle in the model states (read by DeepSpeed on --resume auto), an optimizer shard
    (read by zero_to_fp32 on export), a converted checkpoint (read on conversion) and the exported
    weights: none runs, and each is one line naming the file."""
    from swbert.models import SWBertForMaskedLM
    from swbert.parallel import convert
    from swbert.training import export

    run, marker = _copy(trained, tmp_path), tmp_path / "code-ran"
    step = run / "checkpoints" / "step_00000004"
    converted = convert.to_universal(run / "checkpoints", tmp_path / "universal", "step_00000004")

    shard = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _plant(shard, marker)
    with pytest.raises(SystemExit) as exit_:
        export.main([str(step), "--output", str(tmp_path / "hf")])
    assert not marker.exists() and exit_.value.code == 2
    _one_line_naming(capsys.readouterr().err, shard)

    universal = sorted((converted / "step_00000004" / "zero").glob("*/fp32.pt"))[0]
    _plant(universal, marker)
    with pytest.raises(SystemExit):
        convert.main(["hf", str(converted), str(tmp_path / "hf2")])
    assert not marker.exists()
    _one_line_naming(capsys.readouterr().err, universal)

    weights = run / "export" / "pytorch_model.bin"
    (run / "export" / "model.safetensors").unlink()
    _plant(weights, marker)
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        SWBertForMaskedLM.from_pretrained(run / "export")
    assert not marker.exists()

    model_states = step / "mp_rank_00_model_states.pt"
    _plant(model_states, marker)
    resumed = launch(2, _args(data_dir, run, "--resume", "auto", "--train-steps", "6"))
    assert not marker.exists() and resumed.returncode != 0, resumed.stderr[-3000:]
    _one_line_naming(resumed.stderr, model_states)


@pytest.mark.slow
def test_a_rewind_is_a_branch_and_the_export_holds_the_weights_just_trained(trained, data_dir, tmp_path):
    """Resume from step 2 (with another seed, so the new line differs) to step 4, which the abandoned
    line already holds: step 4 is saved anew, the old one kept under abandoned-*/, and the export
    holds the new weights, not the abandoned run's."""
    from safetensors.torch import load_file

    run = _copy(trained, tmp_path)
    root = run / "checkpoints"
    old_marker = (root / "step_00000004" / ckpt.COMPLETE).read_text()
    old_export = load_file(run / "export" / "model.safetensors")
    rewind = ["--resume", str(root / "step_00000002"), "--seed", "7", "--allow-resume-change", "seed"]
    resumed = launch(2, _args(data_dir, run, *rewind))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    new_export = load_file(run / "export" / "model.safetensors")
    assert any(not torch.equal(new_export[k], old_export[k]) for k in old_export)
    assert "rewinds the run" in resumed.stderr
    (kept,) = root.glob("abandoned-*/step_00000004")
    assert (kept / ckpt.COMPLETE).read_text() == old_marker  # kept whole
    new_marker = root / "step_00000004" / ckpt.COMPLETE
    assert new_marker.read_text() != old_marker and (root / "latest").read_text() == "step_00000004"
    stamp = json.loads((run / "export" / "swbert_export.json").read_text())
    assert stamp == {"checkpoint": "step_00000004", "marker": ckpt.file_hash(new_marker)}


@pytest.mark.slow  # the trained run
def test_export_takes_the_checkpoint_resume_would_and_refuses_a_cut_off_one(trained, tmp_path):
    """Export and --resume agree on which checkpoint a folder means: the newest complete one, not
    whatever `latest` names; a cut-off step folder named directly is refused, naming the one to use."""
    from swbert.training.export import ExportConfig, _tag_dir

    run = _copy(trained, tmp_path)
    root = run / "checkpoints"
    assert _tag_dir(ExportConfig(root, tmp_path / "hf")) == root / "step_00000004"
    (root / "step_00000004" / "complete.json").unlink()  # the last save was cut off
    assert _tag_dir(ExportConfig(root, tmp_path / "hf")) == root / "step_00000002"
    with pytest.raises(ValueError, match="this checkpoint is incomplete.*step_00000002, the newest complete"):
        _tag_dir(ExportConfig(root / "step_00000004", tmp_path / "hf"))
    assert _tag_dir(ExportConfig(root, tmp_path / "hf", tag="step_00000002")) == root / "step_00000002"


# ---- integrity, round two (issue #46): export, conversion and the resumed engine ----------------


@pytest.mark.slow  # the trained run
def test_export_and_conversion_check_the_hashes_first_and_conversions_record_theirs(
    trained, tmp_path, capsys
):
    """Issue #46: an export of a checkpoint with a flipped optimizer byte differed by 0.0156 and
    exited 0, and a universal (converted) checkpoint carried no hashes. Now both refuse a damaged
    checkpoint in one line naming the file (exit 2, nothing written), and a conversion's marker
    records every file it wrote, checked like any other."""
    from swbert.parallel import convert
    from swbert.runtime.checkpoint_format import marker_hashes
    from swbert.training import export

    run = _copy(trained, tmp_path)
    step = run / "checkpoints" / "step_00000004"
    converted = convert.to_universal(run / "checkpoints", tmp_path / "universal", "step_00000004")
    universal = converted / "step_00000004"
    written = {str(p.relative_to(universal)) for p in universal.rglob("*") if p.is_file()}
    recorded = marker_hashes(universal)
    assert recorded and set(recorded) == written - {ckpt.COMPLETE} and ckpt.META in recorded
    assert ckpt.is_complete(universal) and ckpt.mismatched(universal) == []

    shard = step / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip_byte(shard, at=shard.stat().st_size // 2)  # in the weights: it loads, and differs
    with pytest.raises(SystemExit) as exit_:
        export.main([str(step), "--output", str(tmp_path / "hf")])
    assert exit_.value.code == 2 and not (tmp_path / "hf").exists()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and shard.name in lines[0] and "--tag" in lines[0], lines
    for argv in (["universal", str(step.parent), str(tmp_path / "u2"), "--tag", step.name],
                 ["hf", str(step.parent), str(tmp_path / "hf2"), "--tag", step.name]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            convert.main(argv)
        assert exit_.value.code == 2 and not Path(argv[2]).exists()
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
        assert len(lines) == 1 and shard.name in lines[0], lines

    fp32 = sorted((universal / "zero").glob("*/fp32.pt"))[0]
    flip_byte(fp32, at=fp32.stat().st_size // 2)
    with pytest.raises(SystemExit) as exit_:
        convert.main(["hf", str(converted), str(tmp_path / "hf3")])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert exit_.value.code == 2 and len(lines) == 1 and str(fp32.relative_to(universal)) in lines[0]


def _resumed_settings(out: str, data_dir: str, extra: list[str]) -> None:
    """Set up a resume of `out` in this rank; the values the engine uses must be the resolved config's."""
    import yaml

    from swbert.training import build
    from swbert.training.cli import parse_args
    from swbert.training.trainer import Trainer

    argv = _args(Path(data_dir), Path(out), "--resume", "auto", "--train-steps", "6", *extra)
    trainer = Trainer(parse_args(argv))
    run = trainer.setup()
    try:
        resolved = yaml.safe_load((Path(out) / "resolved_config.yaml").read_text())
        ds_config = json.loads((Path(out) / "ds_config.json").read_text())
        optimizer = run.engine.optimizer
        assert resolved["grad_clip"] == ds_config["gradient_clipping"] == 0.25
        assert optimizer.clip_grad == resolved["grad_clip"], optimizer.clip_grad  # ZeRO-1/2's own copy
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(resolved["lr"])  # step 5 of 5 warm-up: the peak
            assert group["betas"] == (resolved["adam_beta1"], resolved["adam_beta2"])
            assert group["eps"] == resolved["adam_eps"]
    finally:
        build.release(run.folder)
        trainer.close_batches()


@pytest.mark.slow  # the trained run
def test_a_grad_clip_changed_on_resume_is_the_one_the_engine_uses(trained, data_dir, tmp_path):
    """Issue #46: under ZeRO-1/2, DeepSpeed restores its optimizer's clip_grad from the checkpoint:
    a --grad-clip given on resume showed in resolved_config.yaml and ds_config.json, and was ignored."""
    from tests.parallel.test_parallel_harness import run_ranks

    run = _copy(trained, tmp_path)
    run_ranks(_resumed_settings, 2, str(run), str(data_dir), ["--grad-clip", "0.25"])


@pytest.mark.slow  # the trained run
def test_an_export_records_its_tokenizer_and_fine_tuning_refuses_another(trained, tmp_path, caplog):
    """Issue #46: an export carried no record of its tokenizer, so fine-tuning took any tokenizer of
    the same size and [PAD] id (another run's, with the same ids meaning other pieces). Now the
    export's config.json records the vocabulary's sha256 and fine-tuning refuses another vocabulary
    unless asked (--allow-tokenizer-change)."""
    from transformers import AutoTokenizer

    from swbert.finetune.checkpoint import CheckpointError, load_tokenizer
    from swbert.runtime.run_tokenizer import tokenizer_fingerprint

    export_dir = trained / "export"
    recorded = json.loads((export_dir / "config.json").read_text())["tokenizer_sha256"]
    assert recorded == tokenizer_fingerprint(AutoTokenizer.from_pretrained(export_dir))
    assert load_tokenizer(export_dir) is not None  # its own tokenizer passes

    other = tmp_path / "other"  # the same files, two pieces swapped: same size, same [PAD] id
    shutil.copytree(export_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]  # piece -> id
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(
        CheckpointError, match=r"other: the tokenizer's vocabulary differs .*--allow-tokenizer-change"
    ):
        load_tokenizer(export_dir, other)
    with caplog.at_level(logging.WARNING, logger="swbert.finetune.checkpoint"):
        assert load_tokenizer(export_dir, other, allow_change=True) is not None
    assert any("used anyway" in r.getMessage() for r in caplog.records)


# ---- held-out evaluation of a checkpoint or an export (python -m swbert.evaluate) ------------------


@pytest.mark.slow  # the trained run
def test_evaluate_equals_the_runs_own_validation_and_names_its_unigram_floor(trained, data_dir, tmp_path):
    """`python -m swbert.evaluate` on the run's checkpoint and on its export gives the validation
    loss and accuracy the run logged at its last step (the same sequences, the same masks: 16, twice
    round the 8 of the split), and a unigram floor equal to one counted here from the documents."""
    from collections import Counter

    from swbert import evaluate
    from swbert.training.data import TrainingData
    from tests.launch_utils import read_metrics

    logged = read_metrics(trained)[4]
    common = ["--data-dir", str(data_dir), "--seq-len", "64", "--sequences", "16", "--batch-size", "8"]
    from_checkpoint = evaluate.main(
        [str(trained / "checkpoints"), *common, "--json", str(tmp_path / "e.json")]
    )
    from_export = evaluate.main([str(trained / "export"), *common])
    for figures in (from_checkpoint, from_export):
        torch.testing.assert_close(figures["loss"], logged["val_loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(figures["mlm_accuracy"], logged["val_mlm_acc"], rtol=1e-6, atol=0)
    assert json.loads((tmp_path / "e.json").read_text()) == from_checkpoint

    data = TrainingData(data_dir, 64, 0.15, 1234)
    corpus = data.train.corpus
    counts = Counter()
    for doc in range(corpus.num_documents):
        counts.update(corpus.document(doc).tolist())
    specials = set(data.special_ids.ids)
    total = sum(
        c + 1 for t, c in ((t, counts.get(t, 0)) for t in range(corpus.vocab_size)) if t not in specials
    )
    targets = [
        t
        for start in (0, 8)
        for t in data.batch(start, 8, 0, 1, valid=0)["mlm_labels"].reshape(-1).tolist()
        if t >= 0
    ]
    floor = sum(-math.log((counts.get(t, 0) + 1) / total) for t in targets) / len(targets)
    torch.testing.assert_close(from_checkpoint["unigram_loss"], floor, rtol=1e-9, atol=0)
    from swbert.data.floors import held_out_floors

    bigram = held_out_floors(data_dir, 64, 0.15, 1234, 16)["bigram"]  # the same tokens, scored alone
    torch.testing.assert_close(from_checkpoint["bigram_loss"], bigram, rtol=1e-9, atol=0)


@pytest.mark.slow  # the trained run
def test_evaluate_refuses_data_of_another_vocabulary(trained, data_dir, tmp_path, capsys):
    export_dir = tmp_path / "export"
    shutil.copytree(trained / "export", export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    config["tokenizer_sha256"] = "0" * 64
    (export_dir / "config.json").write_text(json.dumps(config))
    from swbert import evaluate

    with pytest.raises(SystemExit) as exit_:
        evaluate.main([str(export_dir), "--data-dir", str(data_dir)])
    assert exit_.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert "another vocabulary" in line and "tokenizer_sha256" in line
