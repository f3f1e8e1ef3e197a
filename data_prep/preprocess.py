"""Tokenize a corpus into megatron-core indexed-dataset shards, in parallel and resumably.

    python -m data_prep.preprocess --input PATH [PATH ...] --tokenizer DIR --output DIR --workers N

Each chunk of the input (cut at document boundaries every `--shard-size` bytes) becomes one
shard, written by one worker; a shard counts as finished once its `.json` record exists, so a
killed run redoes only unfinished shards. The documents and their order depend only on the
inputs, the tokenizer and the settings recorded in the manifest, never on `--workers`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_prep import cli
from data_prep.outdir import (
    PLAN_NAME,
    OutputLock,
    check_existing,
    check_output_dir,
    finished_record,
    remove_stale_temporaries,
)
from data_prep.shard_writer import ShardJob
from data_prep.sources import InputError, ReadOptions, Source, plan_chunks, refuse_non_utf8, resolve_inputs
from data_prep.workers import run_jobs
from swbert.cli import parse_or_exit
from swbert.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_SUBDIR,
    shard_name,
    write_json_atomic,
)
from swbert.data.tokenizer import SPM_MODEL_NAME, TOKENIZER_INFO_NAME, tokenizer_hash

log = logging.getLogger("data_prep.preprocess")
DEFAULT_SHARD_BYTES = 16 << 20
DEFAULT_WORKERS = max(1, (os.cpu_count() or 2) - 1)
USAGE = (
    "usage: python -m data_prep.preprocess --input PATH [PATH ...] --tokenizer DIR --output DIR "
    "[--workers N] [--key value ...]\n\n" + (__doc__ or "").split("\n\n")[0]
)


@dataclass(kw_only=True)
class PreprocessConfig(cli.InputOptions):
    """The command line of `python -m data_prep.preprocess` (`swbert.cli`)."""

    tokenizer: str  # tokenizer folder written by python -m data_prep.train_tokenizer
    output: str  # folder for the shards and manifest.json; re-running the same command resumes
    workers: int = DEFAULT_WORKERS  # worker processes, each tokenizing its own shards (default: CPUs - 1)
    # raw input bytes per shard, e.g. 16M; part of the manifest, since it decides where shards are cut
    shard_size: str = cli.size_text(DEFAULT_SHARD_BYTES)
    # fraction of documents held out for validation, chosen by a hash of their text
    valid_fraction: float = 0.01
    overwrite: bool = False  # delete shards in --output that another tokenizer, input or setting made
    no_progress: bool = False  # no progress bar (the summary is still printed)

    def check(self) -> None:
        super().check()
        self.shard_bytes()
        check_output_dir(self.output)

    def shard_bytes(self) -> int:
        return cli.byte_size(self.shard_size, "--shard-size")


@dataclass
class PreprocessResult:
    """What a run did: the manifest plus run statistics that are deliberately not in it."""

    manifest: dict[str, Any]
    output_dir: Path
    shards_written: int
    shards_reused: int
    seconds: float  # the whole call
    work_seconds: float  # tokenizing and writing shards (throughput is measured over this)
    documents_written: int
    tokens_written: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_written / max(self.work_seconds, 1e-9)


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size < 65500 else "int32"  # megatron's DType.optimal_dtype rule


def _copy_tokenizer(tokenizer_dir: Path, output_dir: Path, expected_hash: str) -> Path:
    """Keep a copy of the tokenizer next to the shards, so the folder is self-describing."""
    target = output_dir / TOKENIZER_SUBDIR
    if (target / SPM_MODEL_NAME).is_file() and tokenizer_hash(target) == expected_hash:
        return target
    tmp = output_dir / f".{TOKENIZER_SUBDIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tokenizer_dir, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _plan(
    tokenizer_dir: Path, sources: list[Source], shard_bytes: int, valid_fraction: float, options: ReadOptions
) -> dict[str, Any]:
    """Everything that decides the shards' content; its hash identifies the run for resuming."""
    import sentencepiece as spm

    tok_hash = tokenizer_hash(tokenizer_dir)
    info_path = tokenizer_dir / TOKENIZER_INFO_NAME
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    vocab_size = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / SPM_MODEL_NAME)).get_piece_size()
    tokenizer = {"hash": tok_hash, "vocab_size": vocab_size, "model_type": info.get("model_type")}
    if info.get("lowercase"):  # recorded only when set, so cased shard folders keep their plan id
        tokenizer["lowercase"] = True
    return {
        "format": FORMAT,
        "tokenizer": tokenizer,
        "dtype": _token_dtype(vocab_size),
        "inputs": [source.describe() for source in sources],
        "config": {"shard_bytes": shard_bytes, "valid_fraction": valid_fraction, **asdict(options)},
    }


def preprocess(
    inputs: list[str],
    tokenizer_dir: str | Path,
    output_dir: str | Path,
    *,
    workers: int = 1,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    valid_fraction: float = 0.01,
    options: ReadOptions | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    overwrite: bool = False,
    progress: bool = True,
    check_encoding: bool = True,
) -> PreprocessResult:
    """Write (or finish writing) the shards and `manifest.json` of `output_dir`.

    Raises `InputError` (a `ValueError`) for problems the user can fix: inputs (with
    `check_encoding`, a file that is not UTF-8 text), a tokenizer folder, an `output_dir` that is a
    file, or an output folder holding shards of another tokenizer, inputs or settings.
    """
    started = time.perf_counter()
    options = options or ReadOptions()
    if workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}")
    if not 0.0 <= valid_fraction < 1.0:
        raise InputError(f"--valid-fraction must be in [0, 1), not {valid_fraction}")
    if shard_bytes < 1:
        raise InputError(f"--shard-size must be positive, not {shard_bytes}")
    check_output_dir(output_dir)
    tokenizer_dir = Path(tokenizer_dir)
    try:
        tokenizer_hash(tokenizer_dir)  # a missing tokenizer is reported before any input is read
    except ValueError as err:
        raise InputError(str(err)) from err
    sources, skipped_files = resolve_inputs(
        inputs,
        text_field=options.text_field,
        txt_documents=options.txt_documents,
        hf_config=hf_config,
        hf_split=hf_split,
    )
    if check_encoding:
        refuse_non_utf8(sources)
    plan = _plan(tokenizer_dir, sources, shard_bytes, valid_fraction, options)
    plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with OutputLock(output_dir) as lock:
        existing = check_existing(output_dir, plan, plan_id, tokenizer_dir, overwrite)
        if existing is not None:
            log.info(
                "%s is already complete (its manifest.json matches these inputs and settings)", output_dir
            )
            elapsed = time.perf_counter() - started
            return PreprocessResult(existing, output_dir, 0, len(existing["shards"]), elapsed, 0.0, 0, 0)
        remove_stale_temporaries(output_dir)
        write_json_atomic(output_dir / PLAN_NAME, {**plan, "plan_id": plan_id})
        spm_model = str(
            _copy_tokenizer(tokenizer_dir, output_dir, plan["tokenizer"]["hash"]) / SPM_MODEL_NAME
        )
        jobs = [
            ShardJob(
                i,
                shard_name(i),
                chunk,
                sources[chunk.source],
                options,
                spm_model,
                plan["dtype"],
                valid_fraction,
                plan_id,
                str(output_dir),
            )  # fmt: skip
            for i, chunk in enumerate(plan_chunks(sources, shard_bytes, options))
        ]
        records = {job.index: rec for job in jobs if (rec := finished_record(output_dir, job.name, plan_id))}
        pending = [job for job in jobs if job.index not in records]
        reused = len(records)
        log.info("%d shards planned, %d finished before, %d to write with %d worker(s)",
                 len(jobs), reused, len(pending), min(workers, max(len(pending), 1)))  # fmt: skip
        docs, tokens, work_seconds = run_jobs(
            pending,
            workers,
            records,
            progress=progress,
            total=sum(job.chunk.weight for job in jobs),
            done=sum(jobs[i].chunk.weight for i in records),
            close_fds=(lock.fd,) if lock.fd is not None else (),
        )
        manifest = _assemble(plan, plan_id, [records[job.index] for job in jobs], skipped_files)
        if sum(manifest["splits"][split]["documents"] for split in SPLITS) == 0:
            raise InputError(
                f"the inputs hold no document ({_fmt_counts(manifest['counts']) or 'all empty'})"
            )
        write_json_atomic(output_dir / MANIFEST_NAME, manifest)
    elapsed = time.perf_counter() - started
    result = PreprocessResult(manifest, output_dir, len(pending), reused, elapsed, work_seconds, docs, tokens)
    _log_summary(result)
    return result


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key.replace('_', ' ')}: {value:,}" for key, value in sorted(counts.items()) if value)


def _assemble(
    plan: dict[str, Any], plan_id: str, records: list[dict[str, Any]], skipped_files: list[str]
) -> dict[str, Any]:
    """The manifest: the plan, every shard's record and totals; nothing about this particular run
    (time, workers), so an interrupted-and-resumed run writes the same file as an uninterrupted one."""
    counts: Counter = Counter()
    splits = {split: {"documents": 0, "tokens": 0} for split in SPLITS}
    shards = []
    for record in records:
        counts.update(record["counts"])
        for split in SPLITS:
            splits[split]["documents"] += record[split]["documents"]
            splits[split]["tokens"] += record[split]["tokens"]
        shards.append({key: value for key, value in record.items() if key != "plan_id"})
    return {
        **plan,
        "plan_id": plan_id,
        "splits": splits,
        "counts": dict(sorted(counts.items())),
        "skipped_input_files": skipped_files,
        "shards": shards,
    }


def _log_summary(result: PreprocessResult) -> None:
    manifest, seconds = result.manifest, max(result.seconds, 1e-9)
    train, valid = manifest["splits"]["train"], manifest["splits"]["valid"]
    reused = f" ({result.shards_reused} finished before)" if result.shards_reused else ""
    log.info(
        "wrote %d shards%s in %.1f s: %s documents (train %s, valid %s), %s tokens (train %s, valid %s)",
        result.shards_written,
        reused,
        seconds,
        f"{train['documents'] + valid['documents']:,}",
        f"{train['documents']:,}",
        f"{valid['documents']:,}",
        f"{train['tokens'] + valid['tokens']:,}",
        f"{train['tokens']:,}",
        f"{valid['tokens']:,}",
    )
    work = max(result.work_seconds, 1e-9)
    log.info(
        "throughput: %s docs/s, %s tokens/s (%.1f s tokenizing and writing)",
        f"{result.documents_written / work:,.0f}",
        f"{result.tokens_per_second:,.0f}",
        result.work_seconds,
    )
    if counts := _fmt_counts(manifest["counts"]):
        log.info("skipped or repaired input: %s", counts)
    if manifest["skipped_input_files"]:
        log.info("empty input files skipped: %s", ", ".join(manifest["skipped_input_files"]))
    log.info(
        "manifest: %s; check the shards with: python -m data_prep.verify %s",
        result.output_dir / MANIFEST_NAME,
        result.output_dir,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(PreprocessConfig, argv, USAGE)
    preprocess(
        args.input,
        args.tokenizer,
        args.output,
        workers=args.workers,
        shard_bytes=args.shard_bytes(),
        valid_fraction=args.valid_fraction,
        options=args.read_options(),
        hf_config=args.hf_config,
        hf_split=args.hf_split,
        overwrite=args.overwrite,
        check_encoding=args.invalid_utf8 is None,  # an explicit --invalid-utf8 reads any file
        progress=not args.no_progress,
    )
    return 0


def console_main() -> None:
    """The `swbert-preprocess` command."""
    cli.run_main(main)


if __name__ == "__main__":
    console_main()
