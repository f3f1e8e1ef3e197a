"""Special token ids and the tokenizer folder that `data_prep.train_tokenizer` writes.

Every tokenizer this project trains puts the BERT specials at the same ids, so model code,
the masking collator and converted checkpoints can rely on them without reading a vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers takes seconds to import; only load_tokenizer needs it
    from transformers import PreTrainedTokenizerBase

PAD_ID = 0
UNK_ID = 1
CLS_ID = 2
SEP_ID = 3
MASK_ID = 4
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The special pieces, in id order: `SPECIAL_TOKENS[MASK_ID] == "[MASK]"`."""
SPECIAL_IDS: tuple[int, ...] = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)

SPM_MODEL_NAME = "spm.model"
"""File name of the raw SentencePiece model inside a tokenizer folder."""
TOKENIZER_INFO_NAME = "swbert_tokenizer.json"
"""How the tokenizer was trained (inputs, sample size, model type) and its hash."""


def tokenizer_hash(tokenizer_dir: str | Path) -> str:
    """sha256 of the SentencePiece model file: the identity that shards and checkpoints record.

    The HF files are derived from the `.model` deterministically, so hashing it alone is enough.
    """
    path = Path(tokenizer_dir) / SPM_MODEL_NAME
    if not path.is_file():
        raise ValueError(
            f"{tokenizer_dir} is not a tokenizer folder: {SPM_MODEL_NAME} is missing. "
            "Create one with: python -m data_prep.train_tokenizer --input PATH --output DIR --vocab-size N"
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_tokenizer(tokenizer_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the Hugging Face tokenizer of a folder written by `data_prep.train_tokenizer`.

    The result encodes text as the raw SentencePiece model does and adds `[CLS] ... [SEP]`
    (and `[SEP]` between the two texts of a pair) when `add_special_tokens=True`.
    """
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"{path} holds no tokenizer.json. Create the folder with: "
            "python -m data_prep.train_tokenizer --input PATH --output DIR --vocab-size N"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    for token_id, token in zip(SPECIAL_IDS, SPECIAL_TOKENS):
        if tokenizer.convert_tokens_to_ids(token) != token_id:
            raise ValueError(f"{path}: {token} is not at id {token_id}; this folder was not made by swbert")
    return tokenizer
