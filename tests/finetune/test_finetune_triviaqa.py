"""TriviaQA in SQuAD's form (Table 2's "single + TriviaQA" rows): the official RC layout, the Hub's rows
and an already converted file give the same examples; no download."""

from __future__ import annotations

import json

import pytest

from swbert.finetune.squad_data import SquadDataError
from swbert.finetune.synthetic import write_squad_fixture
from swbert.finetune.triviaqa import find_answer, from_hub_rows, head_words, read_triviaqa_json
from tests.finetune_fixtures import write_triviaqa_fixture


def test_answer_search_is_case_insensitive_on_word_boundaries():
    context = "the alphabet is long ; then Alpha came , and alpha again"
    assert find_answer(context, ["alpha"]) == ("Alpha", 28)  # not inside "alphabet"
    assert find_answer(context, ["then alpha", "alpha"]) == ("then Alpha", 23)  # the earliest wins
    assert find_answer(context, ["beta"]) is None
    assert head_words("  a b  c d", 3) == "  a b  c" and head_words("a b", 5) == "a b"


def test_official_release_layout(tmp_path):
    path = write_triviaqa_fixture(tmp_path, "train", n=4, seed=0)
    examples = read_triviaqa_json(path)  # evidence/ found beside qa/
    # one of each question's two documents holds the answer: the other is dropped
    assert len(examples) == 4 and {e.qid.split("--")[0] for e in examples} == {
        f"tqtrain{i}" for i in range(4)
    }
    for ex in examples:
        start, span = ex.answer_starts[0], ex.answers[0]
        assert ex.context[start : start + len(span)] == span and span[0].isupper()  # as the text spells it
        assert span.lower() in ex.answers[1:]  # every alias scores
    # a context is the document's first N words: an answer after them drops the document
    assert read_triviaqa_json(path, context_words=200) == examples
    with pytest.raises(SquadDataError, match="no question has an answer in the first 1 words"):
        read_triviaqa_json(path, context_words=1)
    with pytest.raises(SquadDataError, match="--triviaqa-evidence-dir"):
        read_triviaqa_json(path, evidence_dir=tmp_path / "nowhere")


def test_hub_rows_and_converted_files(tmp_path):
    row = {
        "question": "where is key ?",
        "question_id": "q1",
        "answer": {"value": "beta", "aliases": ["beta", "BETA"]},
        "entity_pages": {
            "filename": ["a.txt", "b.txt"],
            "wiki_context": ["no answer here", "the key Beta ."],
        },
        "search_results": {"filename": ["w.txt"], "search_context": ["beta first , key"]},
    }
    examples = from_hub_rows([row])
    assert [(e.qid, e.answers[0], e.answer_starts[0]) for e in examples] == [
        ("q1--b.txt", "Beta", 8),
        ("q1--w.txt", "beta", 0),
    ]
    squad = write_squad_fixture(tmp_path / "converted.json", 4)
    assert len(read_triviaqa_json(squad)) == 4  # a file already in SQuAD's form is read as SQuAD
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"Data": [{"Question": "q", "QuestionId": "t1", "EntityPages": []}]}))
    with pytest.raises(SquadDataError, match="has no Answer"):
        read_triviaqa_json(bad)
