"""The embedded default corpus builds offline, once, and feeds the training-side readers."""

from __future__ import annotations

import fcntl
import json
import threading
import time
from pathlib import Path

from data_prep import default_corpus
from data_prep.default_corpus import ensure_default_data
from swbert.data import PackedSequences, open_corpus
from tests.launch_utils import HANG_S

SMALL = {"vocab_size": 600, "workers": 2, "max_corpus_bytes": 150_000}


def test_default_data_builds_once_and_opens(tmp_path: Path, monkeypatch) -> None:
    data_dir = ensure_default_data(tmp_path, **SMALL)
    train, valid = open_corpus(data_dir, "train"), open_corpus(data_dir, "valid")
    assert train.vocab_size == 600 and train.tokenizer_dir is not None
    lines = next((tmp_path / "corpus").glob("*.jsonl")).read_text().splitlines()
    assert train.num_documents + valid.num_documents == len(lines) > 20  # 5% held out, by hash
    assert len(PackedSequences(train, 128)) > 100
    corpus = next((tmp_path / "corpus").glob("*.jsonl"))
    first = json.loads(lines[0])
    assert first["source"].startswith("pydoc_data.topics:") and len(first["text"]) > 100
    info = json.loads(corpus.with_suffix(".info.json").read_text())
    assert "PSF" in info["license"] and info["bytes"] >= SMALL["max_corpus_bytes"]

    manifest = (data_dir / "manifest.json").read_text()

    def built(*_args, **_kwargs):
        raise AssertionError("the default data was built a second time")

    for step in ("write_default_corpus", "train_tokenizer", "preprocess"):
        monkeypatch.setattr(default_corpus, step, built)
    assert ensure_default_data(tmp_path, **SMALL) == data_dir  # found, not built again
    assert (data_dir / "manifest.json").read_text() == manifest


def test_other_callers_wait_for_the_one_building(tmp_path: Path) -> None:
    result: list[Path] = []
    with open(tmp_path / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # stands for rank 0, busy building
        worker = threading.Thread(target=lambda: result.append(ensure_default_data(tmp_path, **SMALL)))
        worker.start()
        time.sleep(1.0)
        assert worker.is_alive() and not result and not (tmp_path / "corpus").exists()
    worker.join(timeout=HANG_S)
    assert result and (result[0] / "manifest.json").is_file()
