"""Tokenize a corpus into megatron-core indexed-dataset shards, in parallel and resumably.

    python -m data_prep.preprocess --input PATH [PATH ...] --tokenizer DIR --output DIR --workers N
        [--num-tasks N --task-index I]

Each chunk of the input (cut at document boundaries every `--shard-size` bytes) becomes one
shard, written by one worker; a shard counts as finished once its `.json` record exists, so a
killed run redoes only unfinished shards. The documents and their order depend only on the
inputs, the tokenizer and the settings recorded in the manifest, never on `--workers` or
`--num-tasks` (tasks on several nodes share one output folder: `data_prep.tasks`).
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
    TASKS_NAME,
    WAIT_SECONDS,
    OutputLock,
    check_existing,
    check_output_dir,
    disk_full_named,
    finished_record,
    remove_stale_temporaries,
    task_lock_name,
)
from data_prep.shard_writer import ShardJob
from data_prep.sources import InputError, ReadOptions, Source, plan_chunks, refuse_non_utf8, resolve_inputs
from data_prep.tasks import (
    check_task_flags,
    claim_tasks,
    describe_missing,
    owns,
    reject,
    rejected_here,
    verify_records,
)
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
from swbert.data.tokenizer import (
    SPM_MODEL_NAME,
    TOKENIZER_INFO_NAME,
    hf_encoder,
    is_swbert_tokenizer,
    is_tokenizer_folder,
    special_ids,
    special_tokens,
    tokenizer_folder_files,
    tokenizer_hash,
)

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

    # tokenizer folder: one written by python -m data_prep.train_tokenizer, or a Hugging Face one
    # (tokenizer.json and/or a WordPiece vocab.txt, with its tokenizer_config.json or
    # special_tokens_map.json), whose own special tokens the manifest records
    tokenizer: str
    output: str  # folder for the shards and manifest.json; re-running the same command resumes
    workers: int = DEFAULT_WORKERS  # worker processes, each tokenizing its own shards (default: CPUs - 1)
    # raw input bytes per shard, e.g. 16M; part of the manifest, since it decides where shards are cut
    shard_size: str = cli.size_text(DEFAULT_SHARD_BYTES)
    # fraction of documents held out for validation, chosen by a hash of their text
    valid_fraction: float = 0.01
    overwrite: bool = False  # delete shards in --output that another tokenizer, input or setting made
    no_progress: bool = False  # no progress bar (the summary is still printed)
    # processes sharing the work into one --output, e.g. one per node (launchers/slurm/preprocess.sbatch);
    # the shards are those of a single run, and the task that finishes last writes the manifest
    num_tasks: int = 1
    task_index: int = 0  # which of the --num-tasks this process is (0..N-1): it writes shards I, I+N, ...

    def check(self) -> None:
        super().check()
        self.shard_bytes()
        check_task_flags(self.num_tasks, self.task_index)
        check_output_dir(self.output)

    def shard_bytes(self) -> int:
        return cli.byte_size(self.shard_size, "--shard-size")


@dataclass
class PreprocessResult:
    """What a run did: the manifest plus run statistics that are deliberately not in it."""

    manifest: dict[str, Any] | None  # None: a task that left the manifest to the tasks still writing
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
    """Keep a copy of the tokenizer next to the shards, so the folder is self-describing: swbert's
    own folder whole, a Hugging Face one's tokenizer files (`tokenizer_folder_files`)."""
    target = output_dir / TOKENIZER_SUBDIR
    if is_tokenizer_folder(target) and tokenizer_hash(target) == expected_hash:
        return target
    tmp = output_dir / f".{TOKENIZER_SUBDIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if is_swbert_tokenizer(tokenizer_dir):
        shutil.copytree(tokenizer_dir, tmp)
    else:
        tmp.mkdir()
        for name, data in tokenizer_folder_files(tokenizer_dir).items():
            (tmp / name).write_bytes(data)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _plan(
    tokenizer_dir: Path, sources: list[Source], shard_bytes: int, valid_fraction: float, options: ReadOptions
) -> dict[str, Any]:
    """Everything that decides the shards' content; its hash identifies the run for resuming."""
    tokenizer = _tokenizer_record(tokenizer_dir)
    return {
        "format": FORMAT,
        "tokenizer": tokenizer,
        "dtype": _token_dtype(tokenizer["vocab_size"]),
        "inputs": [source.describe() for source in sources],
        "config": {"shard_bytes": shard_bytes, "valid_fraction": valid_fraction, **asdict(options)},
    }


def _tokenizer_record(tokenizer_dir: Path) -> dict[str, Any]:
    """The manifest's tokenizer record: its hash, vocabulary size and model type; for a Hugging
    Face folder also its special tokens and their ids (swbert's own have the fixed ids, unrecorded,
    so their shard folders keep their plan id)."""
    tok_hash = tokenizer_hash(tokenizer_dir)
    if not is_swbert_tokenizer(tokenizer_dir):
        encoder = hf_encoder(tokenizer_dir)
        vocab_size = max(encoder.get_vocab(with_added_tokens=True).values()) + 1
        return {
            "hash": tok_hash,
            "vocab_size": vocab_size,
            "model_type": type(encoder.model).__name__,  # WordPiece, BPE, Unigram
            "special_ids": special_ids(tokenizer_dir).to_dict(),
            "special_tokens": special_tokens(tokenizer_dir),
        }
    import sentencepiece as spm

    info_path = tokenizer_dir / TOKENIZER_INFO_NAME
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    vocab_size = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / SPM_MODEL_NAME)).get_piece_size()
    tokenizer = {"hash": tok_hash, "vocab_size": vocab_size, "model_type": info.get("model_type")}
    if info.get("lowercase"):  # recorded only when set, so cased shard folders keep their plan id
        tokenizer["lowercase"] = True
    return tokenizer


def _check_settings(workers: int, valid_fraction: float, shard_bytes: int, tokenizer_dir: Path) -> None:
    if workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}")
    if not 0.0 <= valid_fraction < 1.0:
        raise InputError(f"--valid-fraction must be in [0, 1), not {valid_fraction}")
    if shard_bytes < 1:
        raise InputError(f"--shard-size must be positive, not {shard_bytes}")
    try:  # a missing tokenizer, or one without a mask token, is reported before any input is read
        special_ids(tokenizer_dir, "--tokenizer")
        tokenizer_hash(tokenizer_dir)
    except ValueError as err:
        raise InputError(str(err)) from err


@dataclass
class _Run:
    """One call's fixed facts, passed between its steps."""

    output_dir: Path
    tokenizer_dir: Path
    sources: list[Source]
    skipped_files: list[str]
    plan: dict[str, Any]
    plan_id: str
    options: ReadOptions
    workers: int
    num_tasks: int
    task_index: int
    progress: bool

    def lock_wait(self) -> float:
        # Tasks of an array start together and each holds the folder's lock for a moment.
        return WAIT_SECONDS if self.num_tasks == 1 else 300.0


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
    num_tasks: int = 1,
    task_index: int = 0,
) -> PreprocessResult:
    """Write (or finish writing) the shards and `manifest.json` of `output_dir`.

    With `num_tasks` > 1 this call is task `task_index` of several writing `output_dir` (see
    `data_prep.tasks`): it writes its share of the shards, and the manifest only if it finds every
    shard finished (`PreprocessResult.manifest` is None otherwise).

    Raises `InputError` (a `ValueError`) for problems the user can fix: inputs (with
    `check_encoding`, a file that is not UTF-8 text), a tokenizer folder, an `output_dir` that is a
    file, an output folder holding shards of another tokenizer, inputs or settings, or one whose
    tasks were started with another `num_tasks`.
    """
    started = time.perf_counter()
    options = options or ReadOptions()
    check_task_flags(num_tasks, task_index)
    check_output_dir(output_dir)
    tokenizer_dir = Path(tokenizer_dir)
    _check_settings(workers, valid_fraction, shard_bytes, tokenizer_dir)
    sources, skipped_files = resolve_inputs(inputs, text_field=options.text_field,
                                            txt_documents=options.txt_documents, hf_config=hf_config,
                                            hf_split=hf_split)  # fmt: skip
    if check_encoding:
        refuse_non_utf8(sources)
    plan = _plan(tokenizer_dir, sources, shard_bytes, valid_fraction, options)
    plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run = _Run(output_dir, tokenizer_dir, sources, skipped_files, plan, plan_id, options, workers,
               num_tasks, task_index, progress)  # fmt: skip
    ready = _set_up(run, overwrite)  # the tokenizer copy's folder, or the manifest of a complete run
    if isinstance(ready, dict):  # already complete
        log.info("%s is already complete (its manifest.json matches these inputs and settings)", output_dir)
        elapsed = time.perf_counter() - started
        return PreprocessResult(ready, output_dir, 0, len(ready["shards"]), elapsed, 0.0, 0, 0)
    jobs = _jobs(run, ready, shard_bytes, valid_fraction)
    with OutputLock(output_dir, task_lock_name(task_index)) as task_lock:
        mine = [job for job in jobs if owns(job.index, num_tasks, task_index)]
        remove_stale_temporaries(output_dir, {job.name for job in mine})
        written, reused, counts = _write(run, mine, task_lock)
        manifest = _finish(run, jobs, written, task_lock)
    elapsed = time.perf_counter() - started
    result = PreprocessResult(manifest, output_dir, len(written), reused, elapsed, *counts)
    _log_summary(result)
    return result


def _jobs(run: _Run, tokenizer: str, shard_bytes: int, valid_fraction: float) -> list[ShardJob]:
    """Every shard of the plan, whichever task writes it (the plan does not depend on the tasks)."""
    return [
        ShardJob(i, shard_name(i), chunk, run.sources[chunk.source], run.options, tokenizer,
                 run.plan["dtype"], valid_fraction, run.plan_id, str(run.output_dir))
        for i, chunk in enumerate(plan_chunks(run.sources, shard_bytes, run.options))
    ]  # fmt: skip


def _set_up(run: _Run, overwrite: bool) -> str | dict[str, Any]:
    """Under the folder's lock: the manifest when the folder is already complete, else the tokenizer
    copy's folder, after checking what the folder holds and recording the plan and the tasks."""
    with OutputLock(run.output_dir, wait=run.lock_wait()):
        existing = check_existing(run.output_dir, run.plan, run.plan_id, run.tokenizer_dir, overwrite)
        if existing is not None:
            return existing
        with disk_full_named(run.output_dir, TASKS_NAME):
            claim_tasks(run.output_dir, run.plan_id, run.num_tasks)
        with disk_full_named(run.output_dir, PLAN_NAME):
            write_json_atomic(run.output_dir / PLAN_NAME, {**run.plan, "plan_id": run.plan_id})
        with disk_full_named(run.output_dir, f"the tokenizer copy ({TOKENIZER_SUBDIR}/)"):
            tokenizer = _copy_tokenizer(run.tokenizer_dir, run.output_dir, run.plan["tokenizer"]["hash"])
    return str(tokenizer)


def _write(run: _Run, jobs: list[ShardJob], lock: OutputLock) -> tuple[set[str], int, tuple[float, int, int]]:
    """Write the shards of `jobs` not finished before: their names, how many were finished
    before, and (seconds, documents, tokens) of the work."""
    records = {
        job.index: rec for job in jobs if (rec := finished_record(run.output_dir, job.name, run.plan_id))
    }
    pending = [job for job in jobs if job.index not in records]
    task = f"task {run.task_index} of {run.num_tasks}: " if run.num_tasks > 1 else ""
    log.info("%s%d shards planned, %d finished before, %d to write with %d worker(s)", task, len(jobs),
             len(records), len(pending), min(run.workers, max(len(pending), 1)))  # fmt: skip
    docs, tokens, seconds = run_jobs(
        pending,
        run.workers,
        records,
        progress=run.progress,
        total=sum(job.chunk.weight for job in jobs),
        done=sum(job.chunk.weight for job in jobs if job.index in records),
        close_fds=(lock.fd,) if lock.fd is not None else (),
    )
    return {job.name for job in pending}, len(jobs) - len(pending), (seconds, docs, tokens)


def _finish(run: _Run, jobs: list[ShardJob], written: set[str], lock: OutputLock) -> dict[str, Any] | None:
    """Write the manifest if every shard is finished, after checking the sha256 of those this call
    did not write (another task's, or an earlier run's); None while shards of other tasks are missing.

    Shards that a finishing task moved aside (`rejected/`) are this call's to write again, whichever
    task wrote them first: that task is done, so after a finishing task killed mid-repair nobody
    else would."""
    close_fds = (lock.fd,) if lock.fd is not None else ()
    records = {job.index: finished_record(run.output_dir, job.name, run.plan_id) for job in jobs}
    owed = [
        job
        for job in jobs
        if records[job.index] is None and rejected_here(run.output_dir, job.name, run.plan_id)
    ]
    if owed:
        log.info("%d shard(s) moved aside by a finishing task are not written again yet (%s, ...): writing "
                 "them", len(owed), owed[0].name)  # fmt: skip
        repaired: dict[int, dict[str, Any]] = {}
        run_jobs(owed, run.workers, repaired, progress=False, total=0, done=0, close_fds=close_fds)
        records.update(repaired)
        written = written | {job.name for job in owed}
    missing = [job for job in jobs if records[job.index] is None]
    if missing:
        owners = [job.index % run.num_tasks for job in missing]
        log.info("%s", describe_missing(run.output_dir, [job.name for job in missing], owners, len(jobs)))
        return None
    others = [rec for job in jobs if job.name not in written and (rec := records[job.index])]
    if bad := verify_records(run.output_dir, others, run.workers):
        for name in bad:
            reject(run.output_dir, name)
        redo = [job for job in jobs if job.name in bad]
        fixed: dict[int, dict[str, Any]] = {}
        run_jobs(redo, run.workers, fixed, progress=False, total=0, done=0, close_fds=close_fds)
        records.update(fixed)
    with OutputLock(run.output_dir, wait=run.lock_wait()):
        if (run.output_dir / MANIFEST_NAME).is_file():  # another task finished at the same time
            return json.loads((run.output_dir / MANIFEST_NAME).read_text())
        manifest = _assemble(run.plan, run.plan_id, [records[job.index] for job in jobs], run.skipped_files)
        if sum(manifest["splits"][split]["documents"] for split in SPLITS) == 0:
            raise InputError(
                f"the inputs hold no document ({_fmt_counts(manifest['counts']) or 'all empty'})"
            )
        with disk_full_named(run.output_dir, MANIFEST_NAME):
            write_json_atomic(run.output_dir / MANIFEST_NAME, manifest)
    return manifest


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
    if manifest is None:
        log.info("wrote %d shards (%d finished before) in %.1f s: %s documents, %s tokens", result.shards_written,
                 result.shards_reused, seconds, f"{result.documents_written:,}", f"{result.tokens_written:,}")  # fmt: skip
        return
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
        **args.reading(),
        overwrite=args.overwrite,
        progress=not args.no_progress,
        num_tasks=args.num_tasks,
        task_index=args.task_index,
    )
    return 0


console_main = cli.command(main)  # the `swbert-preprocess` command


if __name__ == "__main__":
    console_main()
