"""Attention variants from outside swbert: installed packages, and modules named on a command line.

A variant is a class registered with `@swbert.models.attention.register_attention(name)`. For a
launcher to build it, the module that registers it must have been imported in every process that
reads a config naming it (each rank of a job, each tool that loads an exported folder). Two ways,
both ours (the paper has no plugin notion):

- an installed package declares the module in the `swbert.attention` entry-point group, and swbert
  imports every such module the first time a variant name is not found (and when a launcher starts):

      [project.entry-points."swbert.attention"]
      my_variant = "my_package.attention"

- `--plugins MODULE_OR_FILE ...` (pretraining and fine-tuning) imports a dotted module name on the
  Python path, or a `.py` file, in each process before the config is checked: fairseq's
  `--user-dir` idea, for a variant still being written.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "swbert.attention"
_installed_loaded = False


def load_installed() -> list[str]:
    """Import every module of the `swbert.attention` entry-point group, once per process; returns
    the ones imported now. One that fails to import is reported and skipped: a broken package must
    not stop runs of the other variants (a config naming its variant still fails, by name)."""
    global _installed_loaded
    if _installed_loaded:
        return []
    _installed_loaded = True
    loaded = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as err:
            dist = entry.dist.name if entry.dist is not None else "an installed package"
            log.warning(
                "attention plugin %s = %s (entry point of %s) failed to import, its variants are "
                "unavailable: %s: %s",
                entry.name,
                entry.value,
                dist,
                type(err).__name__,
                err,
            )
        else:
            loaded.append(entry.value)
    return loaded


def import_plugin(spec: str) -> ModuleType:
    """Import `spec`: a path ending in `.py`, or a dotted module name on the Python path. A file is
    imported under a name made from its resolved path, so every rank (and a second call) gets the
    same module once."""
    if spec.endswith(".py"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"plugins: {spec} is not a file (pass a .py file or a dotted module name)")
        name = f"swbert_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as err:
        # the plugin itself is missing (not a module it imports): say what a plugin may be
        if err.name is not None and (spec == err.name or spec.startswith(err.name + ".")):
            raise ValueError(
                f"plugins: no module named {spec!r} on the Python path; pass a dotted module name "
                "importable here (and on every node) or a path to a .py file"
            ) from None
        raise


def load_plugins(specs: Iterable[str] = ()) -> None:
    """The installed plugins (once), then each of `specs` (`import_plugin`)."""
    load_installed()
    for spec in specs:
        import_plugin(spec)
