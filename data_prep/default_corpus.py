"""The embedded default corpus, so pretraining runs on a fresh machine with no download.

Source: the English prose that ships with every CPython installation, read locally:

* `pydoc_data.topics`: the language reference and library topics that `help()` shows
  (about 0.5 MB of text, 79 topics on CPython 3.11);
* the docstrings of the standard library's own modules (module, class and function
  docstrings, one document per module; about 1.6 MB from 502 modules on CPython 3.11), read
  with `ast`, never imported. Tests, site-packages and IDLE are left out.

Both are under the Python Software Foundation License (PSF-2.0). About 2.1 MB and 0.46 M tokens:
enough to exercise the whole pipeline and watch a small model learn, far too little for a
useful BERT. The corpus depends on the Python version; the manifest records it.
"""

from __future__ import annotations

import ast
import fcntl
import json
import logging
import multiprocessing
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from data_prep.outdir import locks_off, no_locks
from data_prep.preprocess import preprocess
from data_prep.train_tokenizer import train_tokenizer
from swbert.data.corpus import open_corpus
from swbert.data.manifest import MANIFEST_NAME, write_json_atomic
from swbert.data.tokenizer import SPM_MODEL_NAME, tokenizer_hash

log = logging.getLogger("data_prep.default_corpus")
CORPUS_NAME = "python-docs.jsonl"
SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip"}
SKIP_PREFIXES = ("config-", "__pycache__", "pydoc_data", ".")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []

    def walk(folder: Path) -> None:
        for path in sorted(folder.iterdir()):
            if path.name in SKIP or path.name.startswith(SKIP_PREFIXES):
                continue
            if path.is_dir():
                walk(path)
            elif path.suffix == ".py":
                found.append(path)

    walk(root)
    return found


def _docstrings(path: Path) -> str:
    """A module's docstrings in source order, as one document (empty when it has none)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return ""
    parts = []

    def visit(node: ast.AST) -> None:
        doc = (
            ast.get_docstring(node)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            else None
        )
        if doc:
            parts.append(doc)
        for child in getattr(node, "body", []):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child)

    visit(tree)
    return "\n\n".join(parts)


def iter_default_documents(workers: int = 2) -> Iterator[dict[str, str]]:
    """Documents `{"text", "source"}` in a fixed order: the help topics, then the stdlib modules."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package the help topics separately
        topics = {}
    for name in sorted(topics):
        yield {"text": topics[name], "source": f"pydoc_data.topics:{name}"}
    files = _stdlib_files()
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    # Parsing ~600 modules takes several seconds on one core; the files are independent.
    with context.Pool(max(1, workers)) as pool:
        for path, text in zip(files, pool.imap(_docstrings, files, chunksize=8)):
            if text.strip():
                yield {"text": text, "source": f"stdlib:{path.name}"}


def write_default_corpus(path: Path, *, workers: int = 2, max_bytes: int | None = None) -> dict[str, object]:
    """Write the corpus as JSON lines (atomically); returns a description of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    size = documents = 0
    with open(tmp, "w", encoding="utf-8") as stream:
        for document in iter_default_documents(workers):
            line = json.dumps(document, ensure_ascii=False) + "\n"
            stream.write(line)
            size += len(line.encode())
            documents += 1
            if max_bytes is not None and size >= max_bytes:
                break
    os.replace(tmp, path)
    info = {
        "source": "CPython's pydoc_data.topics and standard-library docstrings",
        "license": "Python Software Foundation License (PSF-2.0)",
        "python": sys.version.split()[0],
        "documents": documents,
        "bytes": size,
    }
    write_json_atomic(path.with_suffix(".info.json"), info)
    return info


DATA_HOME = "SWBERT_DATA_HOME"  # where built data lives; default runs/data


def default_root() -> Path:
    """`$SWBERT_DATA_HOME/default`, else `runs/data/default` (relative to the working directory)."""
    return Path(os.environ.get(DATA_HOME, "runs/data")) / "default"


def ensure_default_data(
    root: str | Path | None = None,
    *,
    vocab_size: int = 8000,
    workers: int = 2,
    max_corpus_bytes: int | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Build the default corpus, its tokenizer and its shards under `root` (`default_root()` when
    None), unless already there.

    Returns the data folder that `swbert.data.open_corpus` accepts. Idempotent, and safe to call
    from several processes at once: an exclusive lock on `root` makes one build while the others
    wait, then find it done. Every step is itself atomic or resumable, so a killed build
    continues where it stopped. `max_corpus_bytes` truncates the corpus (for quick smoke runs);
    `tokenizer` (--tokenizer) replaces the trained one, into shards of its own (`shards-tok<hash>`).
    Worker processes are forked: call it before starting threads (the pretraining entry point calls
    it before any process group exists).
    """
    root = Path(root) if root is not None else default_root()
    root.mkdir(parents=True, exist_ok=True)
    suffix = f"v{vocab_size}" if tokenizer is None else f"tok{tokenizer_hash(tokenizer)[:12]}"
    suffix += f"-max{max_corpus_bytes}" if max_corpus_bytes else ""
    corpus = (
        root
        / "corpus"
        / (CORPUS_NAME if not max_corpus_bytes else f"python-docs-max{max_corpus_bytes}.jsonl")
    )
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else root / f"tokenizer-{suffix}"
    data_dir = root / f"shards-{suffix}"
    with open(root / ".build.lock", "w") as lock:
        if not locks_off():
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            except OSError as err:
                if error := no_locks(str(root), err):
                    raise error from None
                raise
        if (data_dir / MANIFEST_NAME).is_file():
            open_corpus(data_dir)  # size checks: raises if the shards were damaged since
            return data_dir
        log.info("building the default corpus under %s (once; about a minute)", root)
        if not corpus.is_file():
            corpus.parent.mkdir(exist_ok=True)
            info = write_default_corpus(corpus, workers=workers, max_bytes=max_corpus_bytes)
            log.info("corpus: %(documents)d documents, %(bytes)d bytes (%(source)s)", info)
        if tokenizer is None and not (tokenizer_dir / SPM_MODEL_NAME).is_file():
            train_tokenizer(
                [str(corpus)], tokenizer_dir, vocab_size=vocab_size, threads=workers, overwrite=True
            )
        preprocess(
            [str(corpus)],
            tokenizer_dir,
            data_dir,
            workers=workers,
            shard_bytes=256 << 10,
            valid_fraction=0.05,
            progress=False,
        )
    return data_dir
