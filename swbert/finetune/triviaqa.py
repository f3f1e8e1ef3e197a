"""TriviaQA reading comprehension in SQuAD's form, for Table 2's "single + TriviaQA" rows: from the
official RC release (JSON and evidence files), a file already in SQuAD's format, or the Hub's
``mandarjoshi/trivia_qa``; the conversion is ours (docs/finetuning.md, "Data")."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from swbert.finetune.glue_data import hub_split
from swbert.finetune.squad_data import SquadDataError, SquadExample, read_squad_json

HUB_DATASET = "mandarjoshi/trivia_qa"
# evidence folder of each document list in the official release
EVIDENCE_FOLDERS = {"EntityPages": "wikipedia", "SearchResults": "web"}


def head_words(text: str, words: int) -> str:
    """``text`` up to the end of its ``words``-th whitespace-separated word (all of it if shorter)."""
    return re.match(rf"(?:\s*\S+){{0,{words}}}", text).group(0)


def find_answer(context: str, aliases: Iterable[str]) -> tuple[str, int] | None:
    """The earliest occurrence of any alias in ``context`` (case-insensitive, not inside a word), as
    (text as it appears in the context, character offset); the longest alias wins a tie."""
    best: tuple[int, int, str] | None = None
    for alias in {a.strip() for a in aliases if a and a.strip()}:
        match = re.search(rf"(?<!\w){re.escape(alias)}(?!\w)", context, flags=re.IGNORECASE)
        if match and (best is None or (match.start(), -len(alias)) < (best[0], -best[1])):
            best = (match.start(), len(alias), match.group(0))
    return None if best is None else (best[2], best[0])


def to_examples(
    qid: str, question: str, aliases: list[str], documents: Iterable[tuple[str, str]], context_words: int
) -> list[SquadExample]:
    """One SQuAD example per (question, document) whose head holds an answer; ``documents`` are
    (name, text) pairs. The found span is the first answer (the training target); the aliases follow."""
    out = []
    for name, text in documents:
        context = head_words(text, context_words)
        found = find_answer(context, aliases)
        if found is None:
            continue
        span, start = found
        others = [a for a in dict.fromkeys(aliases) if a and a != span]
        out.append(
            SquadExample(f"{qid}--{name}", question, context, [span, *others], [start] + [-1] * len(others))
        )
    return out


def read_triviaqa_json(
    path: str | Path, evidence_dir: str | Path | None = None, context_words: int = 400
) -> list[SquadExample]:
    """Examples from an official TriviaQA RC file (or one in SQuAD's format); ``evidence_dir`` holds
    ``wikipedia/`` and ``web/`` (default: the release's ``evidence/`` beside its ``qa/``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SquadDataError(f"{path}: not a readable TriviaQA JSON file ({e})") from e
    if isinstance(data, dict) and "data" in data:
        return read_squad_json(path)  # already converted
    if not isinstance(data, dict) or "Data" not in data:
        raise SquadDataError(
            f"{path}: neither TriviaQA's RC format (a top-level 'Data' list) nor SQuAD's ('data')"
        )
    evidence = Path(evidence_dir) if evidence_dir else path.resolve().parent.parent / "evidence"
    examples: list[SquadExample] = []
    missing: list[str] = []
    for item in data["Data"]:
        answer = item.get("Answer")
        if not answer:
            raise SquadDataError(
                f"{path}: question {item.get('QuestionId', '?')!r} has no Answer (the test set has none; "
                "train on the train file and evaluate on the dev file)"
            )
        aliases = [answer.get("Value", ""), *answer.get("Aliases", [])]
        documents = []
        for key, folder in EVIDENCE_FOLDERS.items():
            for doc in item.get(key, []):
                file = evidence / folder / doc["Filename"]
                if not file.is_file():
                    missing.append(str(file))
                    continue
                documents.append((doc["Filename"], file.read_text(encoding="utf-8", errors="replace")))
        examples += to_examples(item["QuestionId"], item["Question"], aliases, documents, context_words)
    if missing and len(missing) == sum(len(i.get(k, [])) for i in data["Data"] for k in EVIDENCE_FOLDERS):
        raise SquadDataError(
            f"{path}: none of its evidence files is under {evidence} (e.g. {missing[0]}); pass "
            "--triviaqa-evidence-dir, the release's evidence/ folder"
        )
    if not examples:
        raise SquadDataError(
            f"{path}: no question has an answer in the first {context_words} words of a document"
        )
    return examples


def from_hub_rows(rows: Iterable[Mapping[str, Any]], context_words: int = 400) -> list[SquadExample]:
    """Examples from rows of the Hub's ``mandarjoshi/trivia_qa`` (RC configs: evidence text inline)."""
    out: list[SquadExample] = []
    for row in rows:
        answer = row["answer"]
        aliases = [answer.get("value", ""), *answer.get("aliases", [])]
        pages, results = row.get("entity_pages") or {}, row.get("search_results") or {}
        documents = list(zip(pages.get("filename", []), pages.get("wiki_context", [])))
        documents += list(zip(results.get("filename", []), results.get("search_context", [])))
        out += to_examples(row["question_id"], row["question"], aliases, documents, context_words)
    return out


def load_triviaqa_hub(split: str, config: str, context_words: int) -> list[SquadExample]:
    """``mandarjoshi/trivia_qa`` (``split``: train or validation) from the Hub or the local cache."""
    offline = "pass --triviaqa-train-file/--triviaqa-dev-file (the official RC JSON)"
    ds = hub_split(f"{HUB_DATASET}:{config}:{split}", (HUB_DATASET, config, split), SquadDataError, offline)
    examples = from_hub_rows(ds, context_words)
    if not examples:
        raise SquadDataError(f"{HUB_DATASET}:{config}:{split}: no question has an answer in its evidence")
    return examples
