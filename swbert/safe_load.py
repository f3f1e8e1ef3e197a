"""Loading checkpoint files without running code from them.

A pickle can name any callable to run while it is read (`__reduce__`): a checkpoint or export
copied from elsewhere, or tampered with on a shared file system, would run its code in every rank
that loads it. Every load in swbert therefore uses `torch.load(..., weights_only=True)`, which
reads tensors, containers and plain values only, plus the few DeepSpeed types a DeepSpeed checkpoint
holds (`_allowed`): no NumPy type (swbert's own files hold tensors; an older swbert's RNG files with
NumPy arrays are rewritten once by `python -m swbert.upgrade`). DeepSpeed's own loads (`engine.load_checkpoint`, zero_to_fp32, the
universal conversion) pass `weights_only=False`; `weights_only_loads()` overrides that while they run.

A refused file raises `UnsafeCheckpointError`: one line naming the file and what it holds.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def _allowed() -> list[Any]:
    """The non-tensor types DeepSpeed checkpoints hold (seen in ZeRO 0-3 and universal checkpoints,
    fp32 and bf16): nothing in them runs code when rebuilt."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would run code (or holds a type outside the allow-list) when loaded."""


_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)|Trying to \w+ [^.]*|unsupported [^.\n]*", re.I)


def _one_line(path: Any, err: Exception) -> UnsafeCheckpointError:
    text = str(err)
    found = _GLOBAL.search(text)
    what = (found.group(1) or found.group(0)) if found else text.strip().splitlines()[0][:200]
    return UnsafeCheckpointError(
        f"{path}: refused to load, it holds {what}, which is not plain weights (weights_only=True); "
        "a file that would run code when read is never unpickled. Use a checkpoint you made, or "
        "restore this file from its original"
    )


def load(path: str | Path, original: Any = None, **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True)` with `_allowed()`; UnsafeCheckpointError names the file."""
    kwargs.pop("weights_only", None)
    loader = original or torch.load
    try:
        with _only_allowed():
            return loader(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise _one_line(path, err) from None


def _is_torchs(entry: Any) -> bool:
    obj = entry[0] if isinstance(entry, tuple) else entry
    return getattr(obj, "__module__", "").split(".")[0] == "torch"


@contextmanager
def _only_allowed() -> Iterator[None]:
    """While inside, weights_only loads accept torch's own safe types and `_allowed()`, nothing else.

    Safe globals are process-wide, and other packages add to them on import: megatron-core, which
    every training rank imports, registers NumPy arrays, paths, argparse namespaces and more. Those
    would pass any weights_only load swbert makes; they are set aside for the load."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([g for g in saved if _is_torchs(g)] + _allowed())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every `torch.load` made while inside (DeepSpeed's included) is `load`: weights only."""
    original = torch.load

    def forced(f: Any, *args: Any, **kwargs: Any) -> Any:
        if args:  # map_location given by position
            kwargs["map_location"] = args[0]
        return load(f, original, **kwargs)

    torch.load = forced
    try:
        yield
    finally:
        torch.load = original
