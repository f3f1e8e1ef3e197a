"""The run keeps its tokenizer in its own folder, tokenizer files only, and exports take it from
there: nothing else of the data folder (the tokenizer's training record, with the corpus paths of
the machine that trained it) reaches a published model or MLflow."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from swbert.data.tokenizer import tokenizer_hash
from swbert.runtime.checkpoint_format import OutdatedCheckpoint, write_marker
from swbert.runtime.run_tokenizer import keep_in_run, tokenizer_for_export
from swbert.training import checkpoint as ckpt
from swbert.training.export import export
from tests.launch_utils import run_single

TOKENIZER = {"spm.model", "tokenizer.json", "tokenizer_config.json"}


def test_a_run_copies_the_tokenizer_files_only_and_keeps_the_one_it_trained_with(data_dir, tmp_path):
    source = tmp_path / "tok"
    shutil.copytree(data_dir / "tokenizer", source)
    assert "swbert_tokenizer.json" in {p.name for p in source.iterdir()}  # with the corpus paths
    (source / "notes").mkdir()
    (source / "elsewhere.model").symlink_to(source / "spm.model")
    run = tmp_path / "run"
    run.mkdir()
    assert keep_in_run(source, run, write=False) == "tokenizer" and not (run / "tokenizer").exists()
    assert keep_in_run(source, run, write=True) == "tokenizer"
    assert {p.name for p in (run / "tokenizer").iterdir()} == TOKENIZER
    assert keep_in_run(source, run, write=True) == "tokenizer"  # a resume: the same files, kept

    other = tmp_path / "other"
    other.mkdir()
    (other / "spm.model").write_bytes(b"another tokenizer")
    keep_in_run(other, run, write=True)  # no checkpoint depends on the first one yet: replaced
    assert (run / "tokenizer" / "spm.model").read_bytes() == b"another tokenizer"
    keep_in_run(source, run, write=True)
    tag = run / "checkpoints" / ckpt.tag_for(2)
    tag.mkdir(parents=True)
    ckpt.mark_complete(tag, 2, {"model": {}})
    with pytest.raises(ValueError, match=r"holds another tokenizer .* step_00000002 was trained with it"):
        keep_in_run(other, run, write=True)
    assert (run / "tokenizer" / "spm.model").read_bytes() == (source / "spm.model").read_bytes()


def test_export_takes_the_tokenizer_from_inside_the_run_folder(data_dir, tmp_path, caplog):
    run = tmp_path / "run"
    tag = run / "checkpoints" / ckpt.tag_for(2)
    tag.mkdir(parents=True)
    keep_in_run(data_dir / "tokenizer", run, write=True)
    meta = {"model": {"tokenizer_hash": tokenizer_hash(data_dir / "tokenizer")}, "tokenizer_dir": "tokenizer"}
    assert tokenizer_for_export(tag, meta) == (run / "tokenizer").resolve()
    for escape in ("..", "../..", str(tmp_path.name) + "/../../etc"):
        with pytest.raises(ValueError, match="leads out of the run folder"):
            tokenizer_for_export(tag, {**meta, "tokenizer_dir": escape})
    (run / "tokenizer" / "secrets.txt").write_text("not a tokenizer's")
    with pytest.raises(ValueError, match=r"holds files that are not a tokenizer's \(secrets.txt\)"):
        tokenizer_for_export(tag, meta)
    shutil.rmtree(run / "tokenizer")
    with caplog.at_level(logging.WARNING):
        assert tokenizer_for_export(tag, meta) is None
    assert "exporting without a tokenizer: pass --tokenizer DIR" in caplog.text

    # a checkpoint from before: an absolute path, refused naming the command that keeps it in the run
    old = {**meta, "tokenizer_dir": str(data_dir / "tokenizer")}
    with pytest.raises(OutdatedCheckpoint, match=f"python -m swbert.upgrade {tag.parent}, then"):
        tokenizer_for_export(tag, old)


@pytest.mark.slow
def test_a_trained_run_exports_its_own_tokenizer_and_nothing_else(data_dir, tmp_path):
    """A real run: its checkpoints record the tokenizer relative to the run folder, which holds the
    tokenizer files; the export (and so the MLflow model) gets those and no training record. The
    same checkpoint with the absolute path older runs recorded is refused, naming the upgrade."""
    from transformers import AutoTokenizer, pipeline

    from swbert.parallel.convert import main as convert_main

    out = tmp_path / "run"
    args = [
        "--config",
        "tiny_cpu",
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(out),
        "--mlflow",
        "false",
    ]
    result = run_single([*args, "--train-steps", "2", "--save-interval", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    tag = out / "checkpoints" / ckpt.tag_for(2)
    meta = json.loads((tag / "swbert_meta.json").read_text())
    assert meta["tokenizer_dir"] == "tokenizer"
    assert {p.name for p in (out / "tokenizer").iterdir()} == TOKENIZER
    exported = {p.name for p in (out / "export").iterdir()}
    assert TOKENIZER <= exported and "swbert_tokenizer.json" not in exported
    assert len(AutoTokenizer.from_pretrained(out / "export")) == 96
    # the tensor-parallel merge writes the export's folder: tokenizer and README.md too
    convert_main(["hf", str(out / "checkpoints"), str(tmp_path / "merged"), "--tag", tag.name])
    assert {p.name for p in (tmp_path / "merged").iterdir()} == exported - {
        "swbert_export.json"
    }  # the run's stamp
    fill = pipeline("fill-mask", model=str(tmp_path / "merged"), top_k=2)
    assert len(fill(f"the {fill.tokenizer.mask_token} of")) == 2

    # an older run's checkpoint: the absolute path in its meta file, which its marker hashed
    (tag / "swbert_meta.json").write_text(json.dumps({**meta, "tokenizer_dir": str(data_dir / "tokenizer")}))
    write_marker(tag, 2)
    with pytest.raises(OutdatedCheckpoint, match="absolute path.*python -m swbert.upgrade"):
        export(tag, tmp_path / "old-export")
    (tag / "swbert_meta.json").write_text(json.dumps(meta))
    write_marker(tag, 2)
    with pytest.raises(ValueError, match="not the tokenizer the checkpoint was trained with"):
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        (foreign / "spm.model").write_bytes(b"another tokenizer")
        export(tag, tmp_path / "foreign-export", tokenizer_dir=foreign)
