"""Sharded preprocessing: determinism across worker counts, resume after kill -9, verify."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from data_prep.preprocess import preprocess
from data_prep.train_tokenizer import train_tokenizer
from data_prep.verify import verify_dir
from swbert.data import open_corpus
from swbert.training.checkpoint import mark_complete
from tests.launch_utils import HANG_S

REPO = Path(__file__).resolve().parents[2]
ARGS = {"workers": 1, "shard_bytes": 32 << 10, "valid_fraction": 0.1, "progress": False}


def write_corpus(folder: Path, copies: int = 1) -> list[str]:
    """Real English prose (CPython's help topics) as one .txt (blank-line documents) and one .jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)
    with open(folder / "a.txt", "w", encoding="utf-8") as stream:
        for copy in range(copies):
            for name in names[:40]:
                stream.write(f"{copy} {topics[name].replace(chr(10) * 2, chr(10))}\n\n")
    with open(folder / "b.jsonl", "w", encoding="utf-8") as stream:
        for copy in range(copies):
            for name in names[40:]:
                stream.write(json.dumps({"text": f"{copy} {topics[name]}"}) + "\n")
    return [str(folder / "a.txt"), str(folder / "b.jsonl")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prep")
    inputs = write_corpus(root / "corpus")
    train_tokenizer(inputs, root / "tok", vocab_size=800, threads=1)
    return {"root": root, "inputs": inputs, "tok": root / "tok"}


@pytest.fixture(scope="module")
def reference(setup: dict) -> Path:
    out = setup["root"] / "one_worker"
    preprocess(setup["inputs"], setup["tok"], out, **ARGS)
    return out


def _documents(data_dir: Path, split: str) -> list[list[int]]:
    corpus = open_corpus(data_dir, split)
    return [corpus.document(i).tolist() for i in range(len(corpus))]


@pytest.mark.slow
def test_worker_count_does_not_change_documents(setup: dict, reference: Path) -> None:
    out = setup["root"] / "two_workers"
    preprocess(setup["inputs"], setup["tok"], out, **{**ARGS, "workers": 2})
    one = json.loads((reference / "manifest.json").read_text())
    two = json.loads((out / "manifest.json").read_text())
    assert len(one["shards"]) >= 8  # several shards, so two workers really split the work
    assert one == two  # same shards, same bytes (sha256), same counts
    for split in ("train", "valid"):
        assert _documents(reference, split) == _documents(out, split)
    assert one["splits"]["valid"]["documents"] > 0 and one["splits"]["train"]["documents"] > 0
    # Every input document is somewhere: 79 help topics, some split at blank lines in a.txt.
    assert one["splits"]["train"]["documents"] + one["splits"]["valid"]["documents"] >= len(topics)


def test_rerun_skips_finished_shards(setup: dict, reference: Path) -> None:
    result = preprocess(setup["inputs"], setup["tok"], reference, **{**ARGS, "workers": 2})
    assert result.shards_written == 0 and result.shards_reused == len(result.manifest["shards"])


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_same_manifest(setup: dict, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "data_prep.preprocess", "--input", *setup["inputs"], "--tokenizer",
               str(setup["tok"]), "--output", str(out), "--workers", "1", "--shard-size", "32K",
               "--valid-fraction", "0.1", "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + HANG_S
    while not (out / "shard_00001.json").exists():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "preprocess never finished a shard"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)  # the whole job, as a scheduler would: main and worker
    process.wait()
    total = len(json.loads((reference / "manifest.json").read_text())["shards"])
    finished = len(list(out.glob("shard_*.json")))
    assert not (out / "manifest.json").exists()
    assert 2 <= finished < total, f"the kill came too late to test anything ({finished}/{total} shards)"

    result = preprocess(setup["inputs"], setup["tok"], out, **ARGS)
    assert result.shards_reused == finished and result.shards_written == total - finished
    assert (out / "manifest.json").read_text() == (reference / "manifest.json").read_text()
    assert not list(out.glob(".shard_*"))  # the killed worker's half-written files are gone
    assert verify_dir(out)[0] == []


@pytest.mark.slow
def test_verify_names_each_damaged_file(reference: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(reference, damaged)
    assert verify_dir(damaged)[0] == []
    flipped, truncated, missing = (
        damaged / f"shard_0000{i}.train.{s}" for i, s in ((1, "bin"), (2, "bin"), (3, "idx"))
    )
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    os.truncate(truncated, truncated.stat().st_size - 6)
    missing.unlink()

    problems, _ = verify_dir(damaged)
    assert any(str(flipped) in p and "sha256" in p for p in problems)
    assert any(str(truncated) in p and "bytes" in p for p in problems)
    assert any(str(missing) in p and "missing" in p for p in problems)
    named = {p.split(":")[0] for p in problems}
    assert named <= {str(flipped), str(truncated), str(missing), str(truncated).replace(".bin", ".idx")}

    cli = subprocess.run([sys.executable, "-m", "data_prep.verify", str(damaged)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert cli.returncode == 1
    for path in (flipped, truncated, missing):
        assert str(path) in cli.stdout


def test_open_corpus_refuses_damaged_or_foreign_shards(reference: Path, tmp_path: Path) -> None:
    corpus = open_corpus(reference, "train")
    assert corpus.vocab_size == 800 and corpus.tokenizer_dir == reference / "tokenizer"
    with pytest.raises(ValueError, match="tokenizer"):
        open_corpus(reference, "train", expected_tokenizer_hash="0" * 64)
    with pytest.raises(ValueError, match="manifest.json is missing.*data_prep.preprocess"):
        open_corpus(tmp_path, "train")
    damaged = tmp_path / "short"
    shutil.copytree(reference, damaged)
    os.truncate(damaged / "shard_00000.train.bin", 10)
    with pytest.raises(ValueError, match="shard_00000.train.bin"):
        open_corpus(damaged, "train")
    replaced = tmp_path / "replaced"
    shutil.copytree(reference, replaced)
    with open(replaced / "tokenizer" / "spm.model", "ab") as stream:
        stream.write(b"\0")  # the copy no longer is the tokenizer the manifest names
    with pytest.raises(ValueError, match="replaced after preprocessing"):
        open_corpus(replaced, "train")
    assert [p for p in verify_dir(replaced)[0] if "tokenizer" in p and "spm.model" in p]


def test_training_refuses_to_resume_on_shards_of_another_tokenizer(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from swbert.training.config import TrainConfig
    from swbert.training.trainer import Trainer

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)  # one process; the check comes before any process group
    tag = tmp_path / "run" / "checkpoints" / "step_00000010"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text(tag.name)
    other = "f" * 64  # the checkpoint was trained on shards of another tokenizer
    mark_complete(tag, 10, {"model": {"tokenizer_hash": other}})  # today's format, another tokenizer
    ours = json.loads((reference / "manifest.json").read_text())["tokenizer"]["hash"]
    config = TrainConfig(
        data_dir=str(reference), output_dir=str(tmp_path / "run"), resume="auto", mlflow=False
    )
    with pytest.raises(ValueError, match=f"tokenizer_hash: checkpoint '{other}' vs this run '{ours}'"):
        Trainer(config).setup()


def test_documents_round_trip_to_the_text(setup: dict, reference: Path) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(setup["tok"] / "spm.model"))
    decoded = {}
    for split in ("train", "valid"):
        corpus = open_corpus(reference, split)
        assert corpus.num_tokens == int(corpus.doc_lengths.sum()) and np.all(corpus.doc_lengths > 0)
        decoded[split] = {sp.decode(corpus.document(i).tolist()) for i in range(len(corpus))}
    assert not decoded["train"] & decoded["valid"]
    texts = [json.loads(line)["text"] for line in Path(setup["inputs"][1]).read_text().splitlines()]
    assert {sp.decode(sp.encode(text)) for text in texts} <= decoded["train"] | decoded["valid"]
