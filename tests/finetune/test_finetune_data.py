"""GLUE TSV / SQuAD JSON reading, SQuAD windows and span decoding, and the errors bad input gets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from swbert.finetune.checkpoint import CheckpointError, load_tokenizer, parse_checkpoints
from swbert.finetune.glue_data import GlueDataError, encode_glue, load_glue_split, pad_collate
from swbert.finetune.metrics import squad_scores
from swbert.finetune.squad_data import (
    SquadDataError,
    Windows,
    encode_squad_eval,
    encode_squad_train,
    read_squad_json,
)
from swbert.finetune.squad_post import decode_spans
from swbert.finetune.synthetic import write_glue_fixture, write_squad_fixture
from swbert.finetune.tasks import GLUE_TASKS, get_task
from tests.finetune_fixtures import make_checkpoint, make_tokenizer


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    return write_glue_fixture(tmp_path_factory.mktemp("glue"), list(GLUE_TASKS), n_train=20, n_dev=8)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


# ------------------------------------------------------------------------------------------------ GLUE


@pytest.mark.parametrize("name", list(GLUE_TASKS))
def test_every_task_reads_in_glue_layout(glue_dir, name):
    task = get_task(name)
    train = load_glue_split(task, "train", glue_dir)
    assert len(train) == 20 and (train.text_b is not None) == task.is_pair
    assert train.labels.dtype == (np.float32 if task.is_regression else np.int64)
    for split in task.dev_splits:
        dev = load_glue_split(task, split, glue_dir)
        assert len(dev) == 8 and dev.split == split
    if not task.is_regression:
        assert set(train.labels.tolist()) <= set(range(task.num_labels))


def test_cola_has_no_header_and_text_labels_map_to_hub_order(glue_dir):
    first = (glue_dir / "CoLA" / "train.tsv").read_text().splitlines()[0].split("\t")
    ex = load_glue_split(get_task("cola"), "train", glue_dir)
    assert ex.text_a[0] == first[3] and ex.labels[0] == int(first[1])  # the first line is data
    mnli = (glue_dir / "MNLI" / "dev_mismatched.tsv").read_text().splitlines()
    ex = load_glue_split(get_task("mnli"), "validation_mismatched", glue_dir)
    gold = mnli[1].split("\t")[-1]
    assert ex.labels[0] == ["entailment", "neutral", "contradiction"].index(gold)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_byte_order_mark_is_ignored(tmp_path):
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    _write(tmp_path / "MRPC" / "train.tsv", header + "1\t1\t2\tsame\tsame too\n")
    assert load_glue_split(get_task("mrpc"), "train", tmp_path).labels.tolist() == [1]


def test_quotes_are_literal_and_qqp_malformed_rows_are_skipped(tmp_path, caplog):
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    rows = '0\t1\t2\t"What is it?\t"Quoted" too\t1\n1\t3\t4\tshort row\n2\t5\t6\tq a\tq b\t0\n'
    _write(tmp_path / "QQP" / "train.tsv", header + rows)
    ex = load_glue_split(get_task("qqp"), "train", tmp_path)
    assert ex.text_a == ['"What is it?', "q a"] and ex.text_b[0] == '"Quoted" too'
    assert ex.labels.tolist() == [1, 0]
    assert "skipped 1 malformed rows (lines 3)" in caplog.text


@pytest.mark.parametrize(
    "file, content, message",
    [
        (
            "SST-2/train.tsv",
            "text\tlabel\nnice\t1\n",
            r"SST-2/train.tsv, line 1: header has no column 'sentence'",
        ),
        (
            "SST-2/train.tsv",
            "sentence\tlabel\nnice\t1\nbad\t2\n",
            r"SST-2/train.tsv, line 3: label '2' is not one of sst2's labels",
        ),
        (
            "RTE/train.tsv",
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentails\n",
            r"line 2: label 'entails'",
        ),
        ("SST-2/train.tsv", "sentence\tlabel\n", r"SST-2/train.tsv: the train split has no examples"),
        (
            "MRPC/train.tsv",
            "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tonly one\n",
            r"MRPC/train.tsv, line 2: 4 fields, expected at least 5",
        ),
        (
            "STS-B/train.tsv",
            "index\tsentence1\tsentence2\tscore\n0\ta\tb\t7.5\n",
            r"line 2: score 7.5 is outside stsb's range",
        ),
        ("CoLA/train.tsv", "gj04\tyes\t\tA sentence.\n", r"CoLA/train.tsv, line 1: label 'yes'"),
        (
            "SST-2/train.tsv",
            "sentence\tlabel\nnice\t1\n  \t0\n",
            r"SST-2/train.tsv, line 3: example 1's text \(column 'sentence'\) is empty",
        ),
        (
            "CoLA/train.tsv",
            "gj04\t1\t\t\n",
            r"CoLA/train.tsv, line 1: example 0's text \(column 3\) is empty",
        ),
    ],
)
def test_bad_glue_files_name_file_and_row(tmp_path, file, content, message):
    _write(tmp_path / file, content)
    task = get_task(file.split("/")[0])
    with pytest.raises(GlueDataError, match=message):
        load_glue_split(task, "train", tmp_path)


def test_missing_file_says_which_layout_is_expected(tmp_path):
    with pytest.raises(GlueDataError, match=r"MNLI/dev_matched.tsv not found"):
        load_glue_split(get_task("mnli"), "validation_matched", tmp_path)


def test_encoding_pairs_and_padding(glue_dir, tokenizer):
    ex = load_glue_split(get_task("mrpc"), "validation", glue_dir)
    ds = encode_glue(ex, tokenizer, max_length=12)
    batch = pad_collate(tokenizer.pad_token_id)([ds[0], ds[1], ds[2]])
    assert batch["input_ids"].shape[1] <= 12 and batch["input_ids"][:, 0].eq(tokenizer.cls_token_id).all()
    assert batch["token_type_ids"].max() == 1  # the second sentence is segment 1
    assert batch["labels"].tolist() == ex.labels[:3].tolist()
    # with a shorter pair in the batch, it is padded and masked
    short = {k: v[:-2] if isinstance(v, list) else v for k, v in ds[0].items()}
    batch = pad_collate(tokenizer.pad_token_id)([ds[0], short])
    padding = batch["attention_mask"] == 0
    assert padding.any() and batch["input_ids"].masked_select(padding).eq(tokenizer.pad_token_id).all()


# ----------------------------------------------------------------------------------------------- SQuAD


def test_squad_offsets_must_match_the_context(tmp_path):
    path = write_squad_fixture(tmp_path / "dev.json", n=3)
    data = json.loads(path.read_text())
    data["data"][1]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] += 1
    path.write_text(json.dumps(data))
    with pytest.raises(
        SquadDataError, match=r"dev.json, article 1 \('article 1'\), paragraph 0, question 'q1': answer"
    ):
        read_squad_json(path)


def test_squad_version_and_structure_errors(tmp_path):
    path = write_squad_fixture(tmp_path / "v2.json", n=4, version="2.0")
    with pytest.raises(SquadDataError, match="says version v2.0, but --version is 1.1"):
        read_squad_json(path, "1.1")
    _write(tmp_path / "bad.json", '{"version": "1.1", "rows": []}')
    with pytest.raises(SquadDataError, match="bad.json: no top-level 'data'"):
        read_squad_json(tmp_path / "bad.json")
    _write(tmp_path / "empty.json", '{"version": "1.1", "data": []}')
    with pytest.raises(SquadDataError, match="empty.json: no questions"):
        read_squad_json(tmp_path / "empty.json")
    data = json.loads(path.read_text())
    del data["data"][2]["paragraphs"][0]["qas"][0]["question"]
    path.write_text(json.dumps(data))
    with pytest.raises(
        SquadDataError, match=r"v2.json, article 2 \('article 2'\), paragraph 0, question 'q2': no 'question'"
    ):
        read_squad_json(path)


def test_training_windows_point_at_the_answer(tmp_path, tokenizer):
    examples = read_squad_json(
        write_squad_fixture(tmp_path / "t.json", n=12, version="2.0", context_words=40)
    )
    ds = encode_squad_train(examples, tokenizer, Windows(24, 6))
    assert len(ds) > 2 * len(examples)  # 40-word contexts need several windows each
    inside = 0
    for i in range(len(ds)):
        item = ds[i]
        s, e = item["start_positions"], item["end_positions"]
        if s == 0:
            assert e == 0  # [CLS]: no (whole) answer in this window
            continue
        inside += 1
        assert tokenizer.decode(item["input_ids"][s : e + 1]) in {"alpha", "beta", "gamma"}
    answerable = sum(1 for ex in examples if ex.answers)
    assert inside >= answerable  # every answer lies wholly inside at least one window


def test_oracle_logits_decode_to_gold_answers(tmp_path, tokenizer):
    """Logits peaked on the gold span decode back to the gold text; v2 no-answer via [CLS]."""
    examples = read_squad_json(write_squad_fixture(tmp_path / "d.json", n=8, version="2.0", context_words=30))
    feats = encode_squad_eval(examples, tokenizer, Windows(24, 6))
    train = encode_squad_train(examples, tokenizer, Windows(24, 6))
    n, length = len(feats.example_index), 24
    start, end = np.zeros((n, length)), np.zeros((n, length))
    for w in range(n):
        s, e = train[w]["start_positions"], train[w]["end_positions"]
        start[w, s] += 10.0
        end[w, e] += 10.0
    preds = decode_spans(examples, feats, start, end, version="2.0", max_answer_length=5)
    refs = {ex.qid: ex.answers for ex in examples}
    assert squad_scores(preds.answers, refs, "2.0")["exact"] == 100.0
    assert any(a == "" for a in preds.answers.values())  # the unanswerable ones
    # the same logits with a huge threshold never abstain
    eager = decode_spans(examples, feats, start, end, version="2.0", max_answer_length=5, null_threshold=1e9)
    assert all(eager.answers.values())


def test_doc_stride_that_does_not_fit_is_an_error(tmp_path, tokenizer):
    examples = read_squad_json(write_squad_fixture(tmp_path / "d.json", n=2))
    with pytest.raises(SquadDataError, match="--doc-stride"):
        encode_squad_eval(examples, tokenizer, Windows(16, 12))


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_with_another_tokenizer_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (name,) = parse_checkpoints([str(ckpt)])
    assert name.name == "shared"
    other = tmp_path / "other_tok"
    from transformers import BertTokenizer

    BertTokenizer(
        vocab={w: i for i, w in enumerate(["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", "x"])}
    ).save_pretrained(other)
    with pytest.raises(CheckpointError, match=r"other_tok: the tokenizer's \[PAD\] id is 1 but the model"):
        load_tokenizer(ckpt, other)
    big = tmp_path / "big_tok"
    BertTokenizer(
        vocab={
            f"w{i}" if i > 4 else s: i
            for i, s in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [""] * 200)
        }
    ).save_pretrained(big)
    with pytest.raises(CheckpointError, match=r"big_tok: the tokenizer has 205 tokens but the model"):
        load_tokenizer(ckpt, big)
    from swbert import SWBertConfig

    config = SWBertConfig.from_pretrained(ckpt)
    config.tokenizer_sha256 = "0" * 64  # as a fine-tuned folder records it
    config.save_pretrained(ckpt)
    with pytest.raises(
        CheckpointError, match=r"ckpt: the tokenizer's vocabulary differs from the one recorded"
    ):
        load_tokenizer(ckpt)
    with pytest.raises(CheckpointError, match="both named 'shared'"):
        parse_checkpoints([str(ckpt), str(ckpt)])
    with pytest.raises(CheckpointError, match="config.json not found"):
        parse_checkpoints([str(tmp_path / "nowhere")])


# ------------------------------------------------------------------------------- Hub (no download)


def test_hub_splits_map_columns_and_refuse_unlabelled_rows(monkeypatch):
    """The Hub readers with ``datasets.load_dataset`` answering from memory, as a cache would."""
    import datasets

    rows = {
        "mnli": {"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"], "label": [2, 0], "idx": [0, 1]},
        "sst2": {"sentence": ["s"], "label": [-1], "idx": [0]},  # a test split: no labels
        "squad": {"id": ["a", "b"], "title": ["t", "t"], "context": ["x y", "x y"], "question": ["q", "q"],
                  "answers": [{"text": ["y"], "answer_start": [2]}, {"text": [], "answer_start": []}]},
    }  # fmt: skip
    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict(rows[config or "squad"])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ex = load_glue_split(get_task("mnli"), "validation_mismatched")
    assert calls[-1] == ("nyu-mll/glue", "mnli", "validation_mismatched")
    assert (ex.text_a, ex.text_b, ex.labels.tolist()) == (["p1", "p2"], ["h1", "h2"], [2, 0])
    with pytest.raises(GlueDataError, match=r"nyu-mll/glue/sst2:validation, row 0: label -1 outside 0..1"):
        load_glue_split(get_task("sst2"), "validation")
    from swbert.finetune.squad_data import read_squad_hub

    squad = read_squad_hub("2.0", "validation")
    assert calls[-1] == ("rajpurkar/squad_v2", None, "validation")
    assert [(e.qid, e.answers, e.answer_starts) for e in squad] == [("a", ["y"], [2]), ("b", [], [])]


def test_every_flag_of_the_fine_tuning_and_study_launchers_has_a_help_line():
    """`--help` reads each flag's words from the comment beside its field; a field whose default is
    wrapped in parentheses hid its comment there (GLUE's --data-dir)."""
    import dataclasses

    from swbert.cli import field_descriptions
    from swbert.finetune.glue import GlueSweep
    from swbert.finetune.report import ReportConfig
    from swbert.finetune.squad import SquadSweep
    from swbert.scaling.study import StudyConfig

    for cls in (GlueSweep, SquadSweep, ReportConfig, StudyConfig):
        described = field_descriptions(cls)
        assert [f.name for f in dataclasses.fields(cls) if not described.get(f.name)] == [], cls.__name__


def test_an_example_longer_than_the_models_positions_is_refused_naming_it(glue_dir, tokenizer):
    from swbert import SWBertConfig
    from swbert.finetune.glue import GlueSweep, load_task_data

    task = get_task("mrpc")
    sweep = GlueSweep(checkpoint=["c"], output_dir=glue_dir, data_dir=glue_dir, max_seq_length=64)
    lengths = [
        len(ids)
        for ids in encode_glue(load_glue_split(task, "train", glue_dir), tokenizer, 64).features["input_ids"]
    ]
    positions = sorted(lengths)[-1] - 1  # the longest example no longer fits
    index = lengths.index(max(lengths))
    with pytest.raises(
        GlueDataError,
        match=rf"MRPC/train.tsv: example {index} has {max(lengths)} tokens, more than the model's {positions} positions; pass --max-seq-length {positions}",
    ):
        load_task_data(task, tokenizer, sweep, SWBertConfig(max_position_embeddings=positions))
    assert (
        load_task_data(task, tokenizer, sweep, SWBertConfig(max_position_embeddings=max(lengths))).train
        is not None
    )


def test_an_empty_text_from_the_hub_names_the_split_and_example(monkeypatch):
    """The Hub reader holds rows to the TSV reader's rule: an empty text is refused before training."""
    import datasets

    from swbert.finetune import hub
    from swbert.finetune.glue_data import read_glue_hub

    rows = datasets.Dataset.from_dict(
        {"sentence": ["nice", " ", "bad"], "label": [1, 0, 0], "idx": [0, 1, 2]}
    )
    monkeypatch.setattr(hub, "load_hub_dataset", lambda *args: rows)
    with pytest.raises(
        GlueDataError, match=r"glue/sst2:train: example 1's text \(column 'sentence'\) is empty"
    ):
        read_glue_hub(get_task("sst2"), "train")
    # a null second text (the Hub's None) reads as the TSV's empty column, not a None for the tokenizer
    pairs = datasets.Dataset.from_dict(
        {"sentence1": ["a b", "c d"], "sentence2": ["e f", None], "label": [1, 0], "idx": [0, 1]}
    )
    monkeypatch.setattr(hub, "load_hub_dataset", lambda *args: pairs)
    assert read_glue_hub(get_task("mrpc"), "train").text_b == ["e f", ""]
