"""Training-side data: memory-mapped shards, packing, a rank-independent sampler, MLM masking.

The shards come from `data_prep` (offline); this package only reads them.
"""

from swbert.data.corpus import Corpus, open_corpus
from swbert.data.manifest import read_manifest
from swbert.data.masking import MaskingCollator
from swbert.data.packing import PackedSequences
from swbert.data.sampler import GlobalSampler
from swbert.data.tokenizer import (
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    SPECIAL_TOKENS,
    UNK_ID,
    load_tokenizer,
    tokenizer_hash,
)

__all__ = [
    "CLS_ID",
    "MASK_ID",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_IDS",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "Corpus",
    "GlobalSampler",
    "MaskingCollator",
    "PackedSequences",
    "load_tokenizer",
    "open_corpus",
    "read_manifest",
    "tokenizer_hash",
]
