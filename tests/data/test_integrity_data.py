"""What a run reads is what preprocessing wrote, and bad data input is named.

Shards are hashed against the manifest when a pretraining run starts (split over the ranks,
remembered per file identity), and data_prep refuses the inputs and folders it cannot use.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from swbert.data.integrity import CACHE_NAME, ShardCorrupt, assign, manifest_files, verify_shards
from swbert.data.manifest import read_manifest
from tests.launch_utils import HANG_S, _rank_context, free_port, run_single


def corrupt_token(data_dir: Path) -> Path:
    """Change one token id of the first train shard to another id inside the vocabulary, same size."""
    manifest = read_manifest(data_dir)
    path = data_dir / f"{manifest['shards'][0]['name']}.train.bin"
    tokens = np.fromfile(path, dtype=manifest["dtype"])
    middle = len(tokens) // 2
    tokens[middle] = 5 if tokens[middle] != 5 else 6  # ordinary pieces, after the five specials
    tokens.tofile(path)
    return path


@pytest.fixture
def data_copy(data_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy, ignore=shutil.ignore_patterns(CACHE_NAME))
    return copy


def test_same_size_token_corruption_is_named_and_verified_files_are_remembered(data_copy: Path) -> None:
    manifest, cache = read_manifest(data_copy), data_copy / CACHE_NAME
    first = verify_shards(data_copy, manifest, cache)
    assert first.hashed == first.files > 0 and cache.is_file()
    assert verify_shards(data_copy, manifest, cache).hashed == 0  # a restart: nothing re-hashed
    touched = data_copy / f"{manifest['shards'][0]['name']}.train.idx"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 1))
    assert verify_shards(data_copy, manifest, cache).hashed == 1  # only the file that changed
    path = corrupt_token(data_copy)
    with pytest.raises(ShardCorrupt) as err:
        verify_shards(data_copy, manifest, cache)
    message = str(err.value)
    assert message.startswith(str(path.resolve())) and "sha256 differs" in message
    assert f"python -m data_prep.verify {data_copy}" in message and "\n" not in message
    remembered = json.loads(cache.read_text())["files"]
    assert str(path.resolve()) in remembered  # the good verdict of before, for the old identity
    with pytest.raises(ShardCorrupt):  # ... which does not match the changed file
        verify_shards(data_copy, manifest, cache)


def test_the_ranks_share_the_hashing_by_size() -> None:
    from swbert.data.integrity import ShardFile

    files = [ShardFile(f"/d/f{i}", "x", size) for i, size in enumerate([90, 50, 40, 10, 5, 5])]
    shares = [assign(files, rank, 2) for rank in range(2)]
    assert sorted(f.path for share in shares for f in share) == sorted(f.path for f in files)
    assert [sum(f.size for f in share) for share in shares] == [100, 100]
    assert manifest_files("/nowhere", {"shards": []}) == []


def _verify_on_rank(rank: int, data_dir: Path, run_dir: Path, port: int, results) -> None:
    """One of two real ranks (gloo): the training side's shard check, its outcome sent back."""
    import torch.distributed as dist

    from swbert.training.data import TrainingData, verify_data

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        outcome = verify_data(TrainingData(data_dir, 64, 0.15, seed=0), run_dir)
        results.put((rank, "ok", outcome.hashed, outcome.hashed_here))
    except ShardCorrupt as err:
        results.put((rank, "bad", str(err), None))
    finally:
        dist.destroy_process_group()


def _two_ranks(data_dir: Path, run_dir: Path) -> dict[int, tuple]:
    # ranks from the fork server (torch imported there once: two ranks in seconds), never forked from
    # this process, which may have run a process group (tests/parallel/test_parallel_harness.py says why)
    context = _rank_context()
    results, port = context.Queue(), free_port()
    ranks = [
        context.Process(target=_verify_on_rank, args=(r, data_dir, run_dir, port, results)) for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    out = {}
    for _ in ranks:
        rank, *rest = results.get(timeout=HANG_S)
        out[rank] = tuple(rest)
    for process in ranks:
        process.join(timeout=HANG_S)
        assert process.exitcode == 0
    return out


def test_two_ranks_each_hash_a_share_and_reach_one_verdict(data_copy: Path, tmp_path: Path) -> None:
    files = len(manifest_files(data_copy, read_manifest(data_copy)))
    first = _two_ranks(data_copy, tmp_path / "run")
    assert {rank: outcome[:2] for rank, outcome in first.items()} == {0: ("ok", files), 1: ("ok", files)}
    assert first[0][2] >= 1 and first[1][2] >= 1 and first[0][2] + first[1][2] == files
    assert [outcome[1] for outcome in _two_ranks(data_copy, tmp_path / "run").values()] == [0, 0]
    path = corrupt_token(data_copy)
    bad = _two_ranks(data_copy, tmp_path / "run")
    assert bad[0] == bad[1] and bad[0][0] == "bad" and str(path.resolve()) in bad[0][1]  # one rank hashed it


@pytest.mark.slow
def test_a_pretraining_job_refuses_corrupt_shards(data_copy: Path, tmp_path: Path) -> None:
    """The acceptance proof: before shards were hashed at start, this job trained and exited 0."""
    path = corrupt_token(data_copy)
    args = ["--config", "tiny_cpu", "--data-dir", str(data_copy), "--output-dir", str(tmp_path / "run")]
    result = run_single([*args, "--mlflow", "false", "--train-steps", "2", "--save-interval", "2"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert str(path.resolve()) in errors[0] and "python -m data_prep.verify" in errors[0]
    assert not (tmp_path / "run" / "checkpoints" / "step_00000002").exists()


# ---- data bad input, named -------------------------------------------------------------------


def test_a_damaged_index_or_manifest_names_the_shard(data_copy: Path) -> None:
    from swbert.data import open_corpus

    manifest_path = data_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    idx = data_copy / f"{manifest['shards'][0]['name']}.train.idx"
    original = idx.read_bytes()
    header = bytearray(original)
    header[18:26] = (1 << 40).to_bytes(8, "little")  # the sequence count: same size, far too many
    idx.write_bytes(bytes(header))
    with pytest.raises(ValueError, match=rf"^{idx}.*not a readable index.*data_prep.verify"):
        open_corpus(data_copy)
    idx.write_bytes(original)
    shard = manifest["shards"][0]
    shard["train"]["bin_bytes"] = "12"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError, match=rf"shard_00000.train: bin_bytes is '12'.*data_prep.verify {data_copy}"
    ):
        open_corpus(data_copy)
    del shard["train"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="the record of shard_00000 has no 'train' split"):
        open_corpus(data_copy)


def test_a_data_folder_without_its_tokenizer_is_refused_with_the_fix(data_copy: Path) -> None:
    from swbert.training.data import prepare_data

    assert prepare_data(data_copy) == data_copy
    shutil.move(data_copy / "tokenizer", data_copy.parent / "moved-tokenizer")
    with pytest.raises(FileNotFoundError) as err:
        prepare_data(data_copy)
    assert f"copy that tokenizer folder to {data_copy / 'tokenizer'}" in str(err.value)


def _preprocess_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from data_prep import preprocess as preprocess_cli

    with pytest.raises(SystemExit) as exit_info:
        preprocess_cli.cli.run_main(lambda: preprocess_cli.main(argv))
    return exit_info.value.code, capsys.readouterr().err.strip()


def test_input_that_is_not_utf8_is_refused_per_file_unless_asked(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import random

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a_good.txt").write_text("plain english text here.\n" * 50 + "caf\u00e9 na\u00efve.\n")
    (folder / "b_latin1.txt").write_bytes(
        "un caf\u00e9 cr\u00e8me \u00e0 la fran\u00e7aise.\n".encode("latin-1") * 20
    )
    (folder / "c_random.txt").write_bytes(random.Random(0).randbytes(4096).replace(b"\0", b"x"))
    base = ["--tokenizer", str(data_dir.parent / "tok"), "--workers", "1", "--no-progress", "true"]
    code, err = _preprocess_cli(["--input", str(folder), "--output", str(tmp_path / "o1"), *base], capsys)
    assert code == 1 and err.count("\n") == 0 and "Traceback" not in err
    assert (
        err.startswith(f"error: {folder / 'b_latin1.txt'}: 80 byte sequences")
        and "--invalid-utf8 replace" in err
    )
    (folder / "b_latin1.txt").unlink()
    code, err = _preprocess_cli(["--input", str(folder), "--output", str(tmp_path / "o2"), *base], capsys)
    assert code == 1 and err.startswith(f"error: {folder / 'c_random.txt'}: ") and "not UTF-8" in err
    argv = ["--input", str(folder), "--output", str(tmp_path / "o3"), "--invalid-utf8", "replace", *base]
    assert _preprocess_cli(argv, capsys)[0] == 0  # explicit: read, repaired and counted
    assert read_manifest(tmp_path / "o3")["counts"]["invalid_utf8_replaced"] > 0


def test_output_naming_a_file_is_a_one_line_error(data_dir: Path, tmp_path: Path, capsys) -> None:
    from data_prep import preprocess as preprocess_cli

    (tmp_path / "notes.txt").write_text("some text\n")
    argv = ["--input", str(tmp_path / "notes.txt"), "--tokenizer", str(data_dir.parent / "tok")]
    with pytest.raises(SystemExit) as exit_info:
        preprocess_cli.main([*argv, "--output", str(tmp_path / "notes.txt")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err == (
        f"error: --output {tmp_path / 'notes.txt'} is a file, not a folder: name a new (or this run's) "
        "folder for the shards"
    )
    assert (tmp_path / "notes.txt").read_text() == "some text\n"
