"""Hub corpora stored as Parquet (today's wikimedia/wikipedia, BookCorpus copies), read by name and
config, offline: a local folder in the same layout stands in for the Hub (no download in tests)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.preprocess import preprocess
from data_prep.sources import InputError, _looks_like_path, open_parquet, parse_hub_input, resolve_inputs
from data_prep.train_tokenizer import train_tokenizer

# The dataset card's YAML that maps each config to its files, as wikimedia/wikipedia's does.
CARD = """---
configs:
- config_name: 20231101.en
  data_files:
  - split: train
    path: 20231101.en/train-*
- config_name: 20231101.fr
  data_files:
  - split: train
    path: 20231101.fr/train-*
---
"""


@pytest.fixture
def wiki(tmp_path, monkeypatch):
    """wikimedia/wikipedia's layout: <date>.<language>/train-NNNNN-of-NNNNN.parquet, columns id/url/title/text."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "wikipedia"
    for lang, word in [("en", "cat"), ("fr", "chat")]:
        (root / f"20231101.{lang}").mkdir(parents=True)
        for part in range(2):
            texts = [f"article {part}-{i}: the {word} sat on mat {i} ." for i in range(40)]
            table = pa.table(
                {"id": [str(i) for i in range(40)], "url": ["u"] * 40, "title": ["t"] * 40, "text": texts}
            )
            pq.write_table(
                table, root / f"20231101.{lang}" / f"train-{part:05d}-of-00002.parquet", row_group_size=16
            )
    (root / "README.md").write_text(CARD)
    return root


def test_a_config_of_a_parquet_dataset_is_read_file_by_file(wiki, tmp_path):
    sources, _ = resolve_inputs([f"hf:{wiki}"], hf_config="20231101.fr")
    assert [s.path.split("/")[-2:] for s in sources] == [
        ["20231101.fr", "train-00000-of-00002.parquet"],
        ["20231101.fr", "train-00001-of-00002.parquet"],
    ]
    assert all(s.kind == "parquet" and s.describe()["hf_config"] == "20231101.fr" for s in sources)
    # remote files are opened by URL through fsspec, reading the footer and row groups only
    assert open_parquet(f"file://{sources[0].path}").metadata.num_rows == 40

    train_tokenizer([f"hf:{wiki}"], tmp_path / "tok", vocab_size=80, threads=1, hf_config="20231101.en")
    result = preprocess(
        [f"hf:{wiki}"],
        tmp_path / "tok",
        tmp_path / "shards",
        hf_config="20231101.en",
        shard_bytes=1500,
        progress=False,
    )
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    splits = manifest["splits"]
    assert splits["train"]["documents"] + splits["valid"]["documents"] == 80  # en only, both files
    assert {i["hf_config"] for i in manifest["inputs"]} == {"20231101.en"} and len(manifest["shards"]) > 2
    assert result is not None


def test_an_unknown_config_or_split_says_what_to_pass(wiki):
    with pytest.raises(InputError, match=r"--hf-config"):
        resolve_inputs([f"hf:{wiki}"], hf_config="20231101.xx")
    with pytest.raises(InputError, match=r"has no split 'validation'.*train.*--hf-split"):
        resolve_inputs([f"hf:{wiki}"], hf_config="20231101.en", hf_split="validation")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("wikimedia/wikipedia@20231101.en", ("wikimedia/wikipedia", "20231101.en", "train")),
        ("SamuelYang/bookcorpus", ("SamuelYang/bookcorpus", "default", "train")),
        ("squad:validation", ("squad", "default", "validation")),
        ("org/set@cfg.v2:test", ("org/set", "cfg.v2", "test")),
        ("/data/hub@copy/wiki@20231101.fr", ("/data/hub@copy/wiki", "20231101.fr", "train")),
    ],
)
def test_each_input_names_its_own_config_and_split(text, expected):
    hub = parse_hub_input(text, default_config="default")
    assert (hub.name, hub.config, hub.split) == expected
    assert not _looks_like_path(text) or text.startswith("/")  # a bare NAME@CONFIG is a Hub name


@pytest.mark.parametrize("text", ["wikimedia/wikipedia@", "squad:", "@20231101.en", "org/set@:test"])
def test_an_empty_config_or_split_is_refused_naming_the_syntax(text):
    with pytest.raises(InputError, match=r"NAME@CONFIG:SPLIT .*nothing empty"):
        parse_hub_input(text)


def test_two_configs_in_one_command_each_recorded_in_the_manifest(wiki, tmp_path):
    """Wikipedia needs a dump config and BookCorpus none: one command reads both, each input with its
    own (here two configs of the stand-in; --hf-config is the default of the input that names none)."""
    inputs = [f"hf:{wiki}@20231101.en", f"hf:{wiki}"]
    sources, _ = resolve_inputs(inputs, hf_config="20231101.fr")
    assert [(s.path.split("/")[-2], s.hf_config) for s in sources] == [
        ("20231101.en", "20231101.en"), ("20231101.en", "20231101.en"),
        ("20231101.fr", "20231101.fr"), ("20231101.fr", "20231101.fr"),
    ]  # fmt: skip
    with pytest.raises(InputError, match=r"has no split 'test'.*@CONFIG:SPLIT"):
        resolve_inputs([f"hf:{wiki}@20231101.en:test"])
    train_tokenizer(inputs, tmp_path / "tok", vocab_size=80, threads=1, hf_config="20231101.fr")
    preprocess(inputs, tmp_path / "tok", tmp_path / "shards", hf_config="20231101.fr", progress=False)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert [i["hf_config"] for i in manifest["inputs"]] == ["20231101.en"] * 2 + ["20231101.fr"] * 2
    splits = manifest["splits"]
    assert splits["train"]["documents"] + splits["valid"]["documents"] == 160  # both languages
