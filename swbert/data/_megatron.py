"""Megatron's indexed dataset (`.bin`/`.idx`): megatron-core writes and verifies it; a job reads it here.

Importing megatron-core's module runs `megatron/core/__init__.py`, which pulls in the whole
training stack (Transformer Engine probes, torch.compile's inductor: about 3 s of CPU, and
warnings about Transformer Engine / Apex that do not concern the data format). Offline tools
(`data_prep.preprocess`, `data_prep.verify`) import it lazily through `indexed_dataset`. Every
rank of every job opens the index files, so it reads them with `read_index` instead: the index
is a fixed header and three arrays, read with numpy as megatron-core's `_IndexReader` does
(tests/data/test_integrity_data.py holds the two readers equal).
"""

from __future__ import annotations

import functools
import struct
import warnings
from types import ModuleType

import numpy as np


@functools.cache
def indexed_dataset() -> ModuleType:
    """Return `megatron.core.datasets.indexed_dataset`, imported once and quietly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core.datasets import indexed_dataset as module
    return module


INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType: the code of each token type in the header
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def read_index(idx_path: str) -> tuple[np.ndarray, np.ndarray, np.dtype]:
    """(sequence lengths, document indices, token dtype) of a `.idx` file (format version 1).

    Raises ValueError on a bad header, version or token type, and on a file shorter than the
    counts in its header say."""
    with open(idx_path, "rb") as stream:
        head = stream.read(34)  # magic (9 bytes), version (8), dtype code (1), two counts (8 each)
        data = np.frombuffer(stream.read(), dtype=np.uint8)
    if len(head) < 34 or head[:9] != INDEX_HEADER:
        raise ValueError("bad header (not a megatron-core index)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in DTYPE_CODES:
        raise ValueError(
            f"index version {version}, token type code {code}: expected version 1 and a known code"
        )
    need = sequences * (4 + 8) + documents * 8
    if len(data) < need:
        raise ValueError(
            f"{len(data) + 34} bytes, but its header counts {sequences} sequences and {documents} documents"
        )
    lengths = data[: sequences * 4].view(np.int32)
    doc_index = data[sequences * 12 : need].view(np.int64)  # after the lengths and the pointers
    return lengths, doc_index, np.dtype(DTYPE_CODES[code])
