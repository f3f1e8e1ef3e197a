"""Fine-tuning fixtures the tests build and the product does not ship: a tokenizer, a tiny random
checkpoint and a TriviaQA folder in its RC release layout. Their vocabulary and marker words are those of
`swbert.finetune.synthetic` (the quick start's tasks), so the two learn from the same words."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import BertTokenizer

from swbert import SWBertConfig, SWBertForMaskedLM
from swbert.finetune.synthetic import FILLER, MARKERS, VOCAB


def make_tokenizer() -> BertTokenizer:
    """A WordPiece tokenizer over the synthetic tasks' `VOCAB` ([PAD]=0 ... [MASK]=4, as the exports)."""
    return BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=True)


def make_checkpoint(folder: str | Path, attention_type: str = "shared", seed: int = 0) -> Path:
    """Save a tiny, randomly initialised masked-LM checkpoint and its tokenizer to ``folder``."""
    folder = Path(folder)
    torch.manual_seed(seed)
    config = SWBertConfig.from_size(
        "tiny", vocab_size=len(VOCAB), attention_type=attention_type, max_position_embeddings=128
    )
    SWBertForMaskedLM(config).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def write_triviaqa_fixture(root: str | Path, split: str = "train", n: int = 32, seed: int = 0) -> Path:
    """TriviaQA's RC release layout under ``root``: ``qa/wikipedia-<split>.json`` naming evidence files in
    ``evidence/wikipedia/``. "where is key ?" is answered by the marker after "key"; each question has one
    document holding the answer (in a different case, as an alias) and one that does not, which the
    conversion to SQuAD's form drops."""
    rng = random.Random(seed)
    root = Path(root)
    evidence = root / "evidence" / "wikipedia"
    evidence.mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(n):
        target = rng.choice(MARKERS)
        words = [rng.choice(FILLER) for _ in range(30)]
        pos = rng.randrange(len(words) - 1)
        words[pos : pos + 2] = ["key", target.capitalize()]
        pages = []
        for j, text in enumerate([" ".join(words), " ".join(rng.choice(FILLER) for _ in range(30))]):
            name = f"{split}_{i}_{j}.txt"
            (evidence / name).write_text(text, encoding="utf-8")
            pages.append({"DocSource": "TagMe", "Filename": name, "Title": name})
        answer = {"Value": target, "Aliases": [target, target.upper()], "Type": "WikipediaEntity"}
        items.append({"Question": "where is key ?", "QuestionId": f"tq{split}{i}", "Answer": answer,
                      "EntityPages": pages, "SearchResults": []})  # fmt: skip
    path = root / "qa" / f"wikipedia-{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"Data": items, "Domain": "Wikipedia", "Version": 1.0}), encoding="utf-8")
    return path
