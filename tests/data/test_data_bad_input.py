"""Bad input gives a clear error or a counted skip, never a crash inside a worker."""

from __future__ import annotations

import dataclasses
import json
import logging
import tracemalloc
from collections import Counter
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from data_prep import preprocess as preprocess_cli, train_tokenizer as tokenizer_cli, verify as verify_cli
from data_prep.documents import DocumentReader
from data_prep.preprocess import preprocess
from data_prep.sources import Chunk, InputError, ReadOptions, Source
from data_prep.train_tokenizer import train_tokenizer
from swbert.cli import field_descriptions, parse_cli
from swbert.data import open_corpus
from swbert.data._megatron import indexed_dataset, read_index

TEXTS = [topics[name] for name in sorted(topics)[:12]]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    corpus = root / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    train_tokenizer([str(corpus)], root / "tok", vocab_size=600, threads=1)
    return root / "tok"


def run(inputs: list[Path], tok: Path, out: Path, **kwargs) -> dict:
    kwargs = {"workers": 1, "valid_fraction": 0.0, "progress": False, **kwargs}
    return preprocess([str(p) for p in inputs], tok, out, **kwargs).manifest


def documents(out: Path) -> list[list[int]]:
    corpus = open_corpus(out)
    return [corpus.document(i).tolist() for i in range(len(corpus))]


def test_missing_and_empty_inputs_are_clear_errors(tok: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        run([tmp_path / "nope.txt"], tok, tmp_path / "o1")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(InputError, match="empty.txt is empty"):
        run([tmp_path / "empty.txt"], tok, tmp_path / "o2")
    (tmp_path / "odd.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unsupported file type"):
        run([tmp_path / "odd.csv"], tok, tmp_path / "o3")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "empty.txt").write_bytes(b"")
    (folder / "ok.txt").write_text("some real text\n")
    manifest = run([folder], tok, tmp_path / "o4")
    assert manifest["skipped_input_files"] == [str(folder / "empty.txt")]
    (tmp_path / "blank.txt").write_text("\n \n\t\n")
    with pytest.raises(InputError, match="no document"):
        run([tmp_path / "blank.txt"], tok, tmp_path / "o5")


def test_invalid_utf8_is_replaced_or_skipped_and_counted(tok: Path, tmp_path: Path) -> None:
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"good text here\n\nbad \xff\xfe bytes\n\nmore good text\n\ncut \xe2\x82 short\n")
    replaced = run([path], tok, tmp_path / "replace")
    assert replaced["counts"]["invalid_utf8_replaced"] == 2 and replaced["splits"]["train"]["documents"] == 4
    skipped = run([path], tok, tmp_path / "skip", options=ReadOptions(invalid_utf8="skip"))
    assert skipped["counts"]["invalid_utf8_skipped"] == 2 and skipped["splits"]["train"]["documents"] == 2


def test_progress_bar_and_summary_show_rates_and_what_was_skipped(
    tok: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"good text here\n\nbad \xff\xfe bytes\n\nmore good text\n")
    caplog.set_level(logging.INFO, logger="data_prep")
    manifest = run([path], tok, tmp_path / "out", progress=True)
    bar = capsys.readouterr().err
    assert "preprocess" in bar and "docs/s" in bar and "tokens/s" in bar
    summary = caplog.text
    tokens = manifest["splits"]["train"]["tokens"]
    assert f"3 documents (train 3, valid 0), {tokens:,} tokens" in summary
    assert "docs/s" in summary and "tokens/s" in summary
    assert "invalid utf8 replaced: 1" in summary  # the repair is counted where the user looks


def test_txt_documents_are_blank_line_blocks_or_lines_detected_per_file(tok: Path, tmp_path: Path) -> None:
    (tmp_path / "blocks.txt").write_text("first document,\nstill the first.\n\nsecond document.\n")
    (tmp_path / "lines.txt").write_text("one document.\nanother one.\na third.\n")
    manifest = run([tmp_path / "blocks.txt", tmp_path / "lines.txt"], tok, tmp_path / "out")
    assert [source["documents"] for source in manifest["inputs"]] == ["blank", "line"]
    assert manifest["splits"]["train"]["documents"] == 2 + 3
    forced = run(
        [tmp_path / "blocks.txt"], tok, tmp_path / "forced", options=ReadOptions(txt_documents="line")
    )
    assert forced["splits"]["train"]["documents"] == 3 and forced["counts"] == {"empty_documents": 1}


def test_bad_json_lines_and_empty_documents_are_counted(tok: Path, tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    lines = [json.dumps({"text": "kept one"}), json.dumps({"text": ""}), json.dumps({"text": "  \n "}),
             json.dumps({"title": "no text"}), "{not json", json.dumps([1, 2]), "", json.dumps({"text": "kept two"})]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    manifest = run([path], tok, tmp_path / "out")
    assert manifest["splits"]["train"]["documents"] == 2
    assert manifest["counts"] == {"empty_documents": 2, "invalid_json_lines": 1, "missing_text_field": 2}
    with pytest.raises(InputError, match="--text-field"):
        run([path], tok, tmp_path / "out2", options=ReadOptions(text_field="body"))


def test_an_enormous_line_is_one_document_tokenized_in_pieces(tok: Path, tmp_path: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(tok / "spm.model"))
    line = " ".join(TEXTS).replace("\n", " ")[:60_000]
    path = tmp_path / "huge.txt"
    path.write_text("short first\n" + line + "\n" + "x" * 9000 + "\nshort last\n")
    options = ReadOptions(txt_documents="line", piece_bytes=4096)
    out = tmp_path / "out"
    manifest = run([path], tok, out, options=options)
    docs = documents(out)
    assert manifest["splits"]["train"]["documents"] == 4
    assert docs[1] == sp.encode(line)  # cutting at whitespace changes nothing
    # No whitespace to cut at: cut at a character boundary, which starts a new word there.
    assert sp.decode(docs[2]).replace(" ", "") == "x" * 9000
    corpus = open_corpus(out)
    pieces = len(line.encode()) // 4096 + 9000 // 4096  # the two long lines, a sequence per piece
    assert len(indexed_dataset().IndexedDataset(corpus.prefixes[0]).sequence_lengths) >= 2 + pieces
    # A job reads the index without megatron-core (swbert/data/_megatron.py): the same arrays.
    reference = indexed_dataset()._IndexReader(f"{corpus.prefixes[0]}.idx", multimodal=False)
    lengths, doc_index, dtype = read_index(f"{corpus.prefixes[0]}.idx")
    np.testing.assert_array_equal(lengths, reference.sequence_lengths)
    np.testing.assert_array_equal(doc_index, reference.document_indices)
    assert dtype == np.dtype(reference.dtype) and len(doc_index) == 4 + 1 < len(lengths)
    idx = Path(f"{corpus.prefixes[0]}.idx")
    (tmp_path / "short.idx").write_bytes(idx.read_bytes()[:-9])
    with pytest.raises(ValueError, match="header counts"):
        read_index(str(tmp_path / "short.idx"))
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX\x00\x01" + idx.read_bytes()[9:])
    with pytest.raises(ValueError, match="bad header"):
        read_index(str(tmp_path / "bad.idx"))

    json_path = tmp_path / "huge.jsonl"
    json_path.write_text("\n".join(json.dumps({"text": t}) for t in ["before", line, "after"]) + "\n")
    manifest = run([json_path], tok, tmp_path / "json", options=ReadOptions(max_line_bytes=20_000))
    assert manifest["counts"] == {"oversized_lines": 1} and manifest["splits"]["train"]["documents"] == 2


def _peak_reading_one_line(path: Path, megabytes: int) -> tuple[int, int]:
    with open(path, "w") as stream:
        for _ in range(megabytes * 16):
            stream.write("word " * 13_107)  # 64 KiB at a time, never a newline
    size = path.stat().st_size
    reader = DocumentReader(Source("txt", str(path), size), Chunk(0, 0, size, size), ReadOptions(), Counter())
    tracemalloc.start()
    pieces = sum(1 for _ in reader)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return pieces, peak


def test_reading_an_enormous_line_takes_memory_for_one_piece_not_the_line(tmp_path: Path) -> None:
    small_pieces, small_peak = _peak_reading_one_line(tmp_path / "8mb.txt", 8)
    big_pieces, big_peak = _peak_reading_one_line(tmp_path / "32mb.txt", 32)
    assert big_pieces >= 32 and big_pieces >= 3 * small_pieces
    assert big_peak < 1.1 * small_peak and big_peak < (32 << 20) // 2, (small_peak, big_peak)


def test_output_folder_of_another_tokenizer_is_refused(tok: Path, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:4]))
    out = tmp_path / "out"
    run([path], tok, out)
    other = tmp_path / "other_tok"
    train_tokenizer([str(path)], other, vocab_size=500, threads=1)
    with pytest.raises(InputError, match="another tokenizer.*--overwrite"):
        run([path], other, out)
    with pytest.raises(InputError, match="differs in: settings \\(valid_fraction\\)"):
        run([path], tok, out, valid_fraction=0.5)
    manifest = run([path], other, out, overwrite=True)
    assert manifest["tokenizer"]["vocab_size"] == 500 and open_corpus(out).vocab_size == 500


def test_parquet_and_hub_loader_give_the_same_documents_as_jsonl(
    tok: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "part.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    table = pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))})
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=5)
    run([folder / "part.jsonl"], tok, tmp_path / "jsonl")
    run([tmp_path / "part.parquet"], tok, tmp_path / "parquet", shard_bytes=4096)
    run([f"hf:{folder}"], tok, tmp_path / "hub", shard_bytes=8192)  # the datasets code path, offline
    assert documents(tmp_path / "jsonl") == documents(tmp_path / "parquet") == documents(tmp_path / "hub")
    assert len(json.loads((tmp_path / "parquet" / "manifest.json").read_text())["shards"]) >= 2


def test_unknown_dataset_name_offline_is_a_clear_error(tok: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="not a local file or folder.*Hugging Face.*offline"):
        run(["no_such_corpus_anywhere"], tok, tmp_path / "out")


def test_cli_prints_one_line_errors_and_documents_every_flag(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        preprocess_cli.cli.run_main(
            lambda: preprocess_cli.main(
                [
                    "--input",
                    str(tmp_path / "gone.txt"),
                    "--tokenizer",
                    str(tmp_path),
                    "--output",
                    str(tmp_path / "o"),
                ]
            )  # fmt: skip
        )
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "spm.model" in err
    for config in (preprocess_cli.PreprocessConfig, verify_cli.VerifyConfig):
        described = field_descriptions(config)
        for f in dataclasses.fields(config):
            assert f.name in described, (config.__name__, f.name)


@pytest.mark.parametrize(
    "tool, argv, meant",
    [
        (tokenizer_cli, ["--input", "c.txt", "--output", "tok", "--vocab-sise", "100"], "vocab_size"),
        (
            preprocess_cli,
            ["--input", "c.txt", "--tokenizer", "t", "--output", "o", "--worker", "2"],
            "workers",
        ),
        (verify_cli, ["--data-dri", "shards"], "data_dir"),
    ],
)
def test_every_tool_refuses_a_misspelt_flag_and_shows_its_help(tool, argv, meant, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"did you mean {meant!r}" in err, err
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--help"])
    assert exit_info.value.code == 0
    assert f"usage: python -m {tool.__name__}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--shard-size", "12Q", "--shard-size '12Q': not a size such as 65536, 512K, 16M or 1G"),
        ("--max-line-bytes", "0", "--max-line-bytes '0': must be at least one byte"),
    ],
)
def test_byte_sizes_are_checked_before_any_work(flag, value, message, tmp_path: Path, capsys) -> None:
    argv = ["--input", "gone.txt", "--tokenizer", "tok", "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        preprocess_cli.main([*argv, flag, value])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == f"error: {message}"
    assert not (tmp_path / "o").exists()
    config = parse_cli(preprocess_cli.PreprocessConfig, [*argv, "--shard-size", "512K"], "usage")
    assert config.shard_bytes() == 512 << 10 and config.read_options().max_line_bytes == 64 << 20
