"""SQuAD v1.1 / v2.0: reading the official JSON files (or the Hub copies) and building windows.

A context longer than the model's window is cut into overlapping windows (``doc_stride`` tokens of
overlap) with the tokenizer's ``return_overflowing_tokens``; ``offset_mapping`` ties every context
token back to its characters so a predicted token span becomes a substring of the context. Training
windows that do not contain the whole answer (and unanswerable questions) point at ``[CLS]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from swbert.finetune.glue_data import EncodedDataset, hub_split, model_inputs

HUB_DATASETS = {"1.1": "rajpurkar/squad", "2.0": "rajpurkar/squad_v2"}


class SquadDataError(ValueError):
    """A SQuAD file (or Hub split) that cannot be used as it is."""


@dataclass
class SquadExample:
    qid: str
    question: str
    context: str
    answers: list[str] = field(default_factory=list)  # gold answer texts; none: unanswerable (v2.0)
    answer_starts: list[int] = field(default_factory=list)


def read_squad_json(path: str | Path, version: str | None = None) -> list[SquadExample]:
    """Read an official SQuAD file, checking every answer's offsets and, when given, ``version``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SquadDataError(f"{path}: not a readable SQuAD JSON file ({e})") from e
    if not isinstance(data, dict) or "data" not in data:
        raise SquadDataError(f"{path}: no top-level 'data' list; is this an official SQuAD file?")
    file_version = str(data.get("version", "")).lstrip("v")
    if version is not None and file_version and file_version != version:
        raise SquadDataError(f"{path}: the file says version {data['version']}, but --version is {version}")
    examples: list[SquadExample] = []
    for ai, article in enumerate(data["data"]):
        for pi, para in enumerate(article.get("paragraphs", [])):
            where = f"{path}, article {ai} ({article.get('title', '?')!r}), paragraph {pi}"
            if "context" not in para or "qas" not in para:
                raise SquadDataError(f"{where}: a paragraph needs 'context' and 'qas'")
            context = para["context"]
            for qa in para["qas"]:
                for key in ("id", "question", "answers"):
                    if key not in qa:
                        raise SquadDataError(f"{where}, question {qa.get('id', '?')!r}: no {key!r} field")
                texts = [a["text"] for a in qa["answers"]]
                starts = [int(a["answer_start"]) for a in qa["answers"]]
                for text, start in zip(texts, starts):
                    if (found := context[start : start + len(text)]) != text:
                        raise SquadDataError(
                            f"{where}, question {qa['id']!r}: answer {text!r} at offset {start} does not match "
                            f"the context there ({found!r})"
                        )
                if not texts and not qa.get("is_impossible", False):
                    raise SquadDataError(
                        f"{where}, question {qa['id']!r}: no answers and not marked is_impossible"
                    )
                examples.append(SquadExample(qa["id"], qa["question"], context, texts, starts))
    if not examples:
        raise SquadDataError(f"{path}: no questions")
    return examples


def read_squad_hub(version: str, split: str) -> list[SquadExample]:
    """Load ``rajpurkar/squad`` (v1.1) or ``rajpurkar/squad_v2`` (v2.0) from the Hub or the local cache."""
    name, official = HUB_DATASETS[version], f"v{version}.json"
    offline = f"pass the official JSON files: --train-file {version}=train-{official} --dev-file {version}=dev-{official}"
    ds = hub_split(f"{name}:{split}", (name, None, split), SquadDataError, offline)
    answers = [(list(r["answers"]["text"]), list(r["answers"]["answer_start"])) for r in ds]
    out = [SquadExample(r["id"], r["question"], r["context"], *a) for r, a in zip(ds, answers)]
    if not out:
        raise SquadDataError(f"{name}:{split}: no questions")
    return out


@dataclass(frozen=True)
class Windows:
    """Windows of `max_length` tokens (question included) overlapping by `doc_stride`."""

    max_length: int
    doc_stride: int
    use_token_type_ids: bool = True


def _tokenize_windows(examples: list[SquadExample], tokenizer, windows: Windows):
    max_length, doc_stride = windows.max_length, windows.doc_stride
    if not getattr(tokenizer, "is_fast", False):
        raise SquadDataError(
            f"{type(tokenizer).__name__} is not a fast tokenizer; SQuAD needs offset mappings"
        )
    if doc_stride >= max_length // 2:
        raise SquadDataError(f"--doc-stride {doc_stride} must be well below --max-seq-length {max_length}")
    if tokenizer.padding_side != "right":
        raise SquadDataError(
            "the tokenizer pads on the left; SQuAD windows assume question first, padding right"
        )
    # Leading white space in questions wastes window room and can even push the context out.
    questions = [ex.question.lstrip() for ex in examples]
    longest_q = max(len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions)
    if max_length - longest_q - 3 <= doc_stride:
        # The fast tokenizer panics (and kills the process) rather than raising in this case.
        raise SquadDataError(
            f"a question of {longest_q} tokens leaves no room for --doc-stride {doc_stride} in --max-seq-length {max_length}"
        )
    return tokenizer(
        questions,
        [ex.context for ex in examples],
        truncation="only_second",
        max_length=max_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )


def encode_squad_train(examples: list[SquadExample], tokenizer, windows: Windows) -> EncodedDataset:
    """Training windows with ``start_positions``/``end_positions`` (``[CLS]`` when the answer is not inside)."""
    features = encode_squad_eval(examples, tokenizer, windows)
    spans = []
    for ex_i, offsets, cls in zip(features.example_index, features.offsets, features.cls_index):
        ex = examples[ex_i]
        ctx = [t for t, o in enumerate(offsets) if o is not None]
        # Train on the first gold answer, as the official BERT recipe does.
        a_start = ex.answer_starts[0] if ex.answers else 0
        a_end = a_start + len(ex.answers[0]) if ex.answers else 0
        if not ex.answers or not ctx or offsets[ctx[0]][0] > a_start or offsets[ctx[-1]][1] < a_end:
            spans.append((cls, cls))
            continue
        s = next(t for t in ctx if offsets[t][1] > a_start)
        spans.append((s, next(t for t in reversed(ctx) if offsets[t][0] < a_end)))
    starts, ends = np.asarray(spans, np.int64).reshape(-1, 2).T
    features.dataset.labels = {"start_positions": starts, "end_positions": ends}
    return features.dataset


@dataclass
class SquadEvalFeatures:
    """Evaluation windows plus what post-processing needs to map tokens back to text."""

    dataset: EncodedDataset
    example_index: list[int]  # window -> index of its question in the example list
    offsets: list[list[tuple[int, int] | None]]  # window -> each token's span in the context (or None)
    cls_index: list[int]


def encode_squad_eval(examples: list[SquadExample], tokenizer, windows: Windows) -> SquadEvalFeatures:
    """Evaluation windows; tokens outside the context get a None offset so no span can land there."""
    enc = _tokenize_windows(examples, tokenizer, windows)
    offsets = []
    for i, off in enumerate(enc["offset_mapping"]):
        seq = enc.sequence_ids(i)
        offsets.append([tuple(o) if seq[t] == 1 else None for t, o in enumerate(off)])
    cls_id = tokenizer.cls_token_id
    cls = [ids.index(cls_id) if cls_id is not None and cls_id in ids else 0 for ids in enc["input_ids"]]
    dataset = EncodedDataset(model_inputs(enc, windows.use_token_type_ids))
    return SquadEvalFeatures(dataset, list(enc["overflow_to_sample_mapping"]), offsets, cls)
