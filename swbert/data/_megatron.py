"""The one place that imports megatron-core's indexed dataset (`.bin`/`.idx`) module.

Importing it runs `megatron/core/__init__.py`, which pulls in the whole training stack
(several seconds, and warnings about Transformer Engine / Apex that do not concern the data
format). Importing lazily keeps `import swbert.data` and the tokenizer CLI fast; nothing in the
indexed dataset code needs CUDA.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType


@functools.cache
def indexed_dataset() -> ModuleType:
    """Return `megatron.core.datasets.indexed_dataset`, imported once and quietly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core.datasets import indexed_dataset as module
    return module
