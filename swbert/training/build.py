"""The steps that set a pretraining run up, each a function that can be called and tested alone.

`Trainer.setup` calls them in this order; the order matters and the comments say why:

    folder = open_run_folder(cfg)          # paths and the one-job lock: refused at once if busy
    plan = plan_run(cfg)                   # precision, batch shape, DeepSpeed config
    data = build_data(cfg)                 # the shards, found and checked
    record = run_record(...)               # what exact resume depends on
    resolve_resume(...)                    # refused here, before any process group, if incompatible
    dims, mpu = build_layout(cfg, plan)    # process group, tensor-parallel groups
    check_shards(data, folder.output_dir)  # sha256 of every shard, split over the ranks
    resume = resolve_resume(...)           # collective: agreed, hashes verified (swbert.training.resume)
    model = build_model(...)               # seeded weights, then wrappers: TP, checkpointing, compile
    engine, scheduler = build_engine(...)  # optimizer, schedule, deepspeed.initialize
    metrics = build_tracking(...)          # metrics.jsonl and MLflow (rank 0)

Everything that can be wrong with a request is checked before the process group starts, so a bad
flag fails at once on every rank instead of hanging a collective.
"""

from __future__ import annotations

import json
import logging
import math
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from swbert.data.mix import metric_name, parse_data_mix
from swbert.logs import status
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.config import SIZES
from swbert.models.flops import masked_lm_params
from swbert.runtime.cpu import keep_freed_memory, optimize_for_cpu, resolve_cpu_kernels, set_cpu_threads
from swbert.runtime.dist import (
    bound_every_group,
    init_distributed,
    map_launcher_env,
    watch_for_lost_ranks,
)
from swbert.runtime.ds_config import (
    BatchShape,
    build_ds_config,
    offloads_optimizer,
    resolve_precision,
    zero_stage,
)
from swbert.runtime.optim import build_optimizer, build_scheduler, resolve_optimizer
from swbert.runtime.ranks import ParallelDims
from swbert.training import checkpoint as ckpt
from swbert.training.config import OPTIMIZER_SETTINGS, TrainConfig, dump_config
from swbert.training.data import TrainingData, prepare_data, resolve_num_workers, verify_data
from swbert.training.metrics import MetricsLogger
from swbert.training.runlock import RunLock
from swbert.training.wrappers import wrap_model

log = logging.getLogger("swbert.train")


def pretraining_ds_config(config: TrainConfig, dp_size: int, precision: str) -> dict[str, Any]:
    """The pretraining run's DeepSpeed config: batch shape, clipping and precision from `config`."""
    batch = BatchShape(*config.batch_layout(dp_size))
    return build_ds_config(config.deepspeed_config, batch, config.grad_clip, precision)


@dataclass
class RunFolder:
    """Where a run lives; rank 0 holds its lock for the job's lifetime."""

    output_dir: Path
    run_name: str
    lock: RunLock | None = None

    @property
    def ckpt_root(self) -> Path:
        return self.output_dir / "checkpoints"


def open_run_folder(cfg: TrainConfig) -> RunFolder:
    """The run folder, locked by rank 0 (one job per folder); a fresh run refuses a folder that
    already holds checkpoints."""
    map_launcher_env()
    run_name = cfg.run_name or f"{cfg.size}-{cfg.attention_type}"
    folder = RunFolder(Path(cfg.output_dir or f"runs/{run_name}"), run_name)
    if os.environ["RANK"] == "0":
        folder.lock = RunLock(folder.output_dir).acquire()
    try:  # an older swbert's checkpoints are refused (naming the upgrade), not set aside as cut off
        ckpt.require_current_folder(folder.ckpt_root, f"--output-dir {folder.output_dir}: ")
    except ValueError:
        release(folder)
        raise
    if cfg.resume == "none" and ckpt.newest_complete(folder.ckpt_root):
        release(folder)
        raise ValueError(
            f"{folder.output_dir} already holds a run with checkpoints; pass --resume auto to continue it, "
            "or choose a new --output-dir"
        )
    return folder


def release(folder: RunFolder) -> None:
    if folder.lock is not None:
        folder.lock.release()
        folder.lock = None


@dataclass(frozen=True)
class RunPlan:
    """What the request resolves to on this machine, before any process group exists."""

    dims: ParallelDims  # the grid from the launcher's environment (no groups yet)
    on_gpu: bool
    precision: str
    cpu_kernels: bool
    compile: bool  # torch.compile the model per unit (swbert.training.wrappers)
    ds_config: dict[str, Any]
    batch: BatchShape

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)


def plan_run(cfg: TrainConfig) -> RunPlan:
    """What `cfg` resolves to with the launcher's ranks. A rank's share of the global batch smaller
    than `cfg.micro_batch_size` becomes the micro-batch (`TrainConfig.batch_layout`): `cfg` is
    lowered to it, with a status line, so the loader, the memory check and the saved config all
    use the micro-batch that runs."""
    dims = ParallelDims.from_env(cfg.tensor_parallel)
    batch = BatchShape(*cfg.batch_layout(dims.dp_size))
    if batch.micro_batch != cfg.micro_batch_size:
        status.info(
            "micro-batch %d per rank: global batch %d over %d data-parallel ranks is %d sequences each, "
            "fewer than micro_batch_size=%d (the most per pass); one pass per step, no accumulation",
            batch.micro_batch, batch.global_batch, dims.dp_size, batch.micro_batch, cfg.micro_batch_size,
        )  # fmt: skip
        cfg.micro_batch_size = batch.micro_batch
    on_gpu = torch.cuda.is_available()
    precision = resolve_precision(cfg.precision, on_gpu)
    compile_model = cfg.compile == "on" or (cfg.compile == "auto" and on_gpu and not cfg.document_attention)
    cpu_kernels = resolve_cpu_kernels(cfg.cpu_kernels, on_gpu, compile_model)
    if compile_model:
        check_compiler(torch.device("cuda" if on_gpu else "cpu"), cfg.compile_backend)
    ds_config = pretraining_ds_config(cfg, dims.dp_size, precision)
    check_sequence_fits(cfg, on_gpu, device_memory(on_gpu))
    return RunPlan(dims, on_gpu, precision, cpu_kernels, compile_model, ds_config, batch)


def device_memory(on_gpu: bool) -> int:
    """Bytes one rank may use: its GPU's, or the machine's memory shared by the ranks on it."""
    if on_gpu:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")) or 1)
    return psutil.virtual_memory().total // max(local, 1)


def check_sequence_fits(cfg: TrainConfig, on_gpu: bool, memory: int) -> None:
    """Refuse a sequence length whose activations of one micro-batch cannot fit in `memory`, before
    any work: `--seq-len 100000` used to start and run for minutes without a step. A lower bound
    only: per token and layer the block keeps at least 2d + f values; on a CPU the attention kernel
    also holds one layer's (heads x S x S) fp32 scores (a GPU's flash kernel holds none)."""
    shape = SIZES[cfg.size]
    d, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"] // cfg.tensor_parallel
    tokens = cfg.micro_batch_size * cfg.seq_len
    need = 4 * tokens * layers * (2 * d + f)
    if not on_gpu:
        need += 4 * cfg.micro_batch_size * heads * cfg.seq_len**2
    if need > memory:
        raise ValueError(
            f"seq_len={cfg.seq_len} with micro_batch_size={cfg.micro_batch_size} needs at least "
            f"{need / 2**30:,.1f} GiB of activations per rank at size {cfg.size}, more than the "
            f"{memory / 2**30:,.1f} GiB of this {'GPU' if on_gpu else 'machine (per local rank)'}; "
            "lower --seq-len or --micro-batch-size"
        )


def check_compiler(device: torch.device, backend: str = "inductor") -> None:
    """Compile and run a one-line function, so a torch without a working compiler (no C/C++
    toolchain for inductor, an unsupported GPU) or a backend name torch does not know fails here,
    before any process group, with one clear error instead of a stack of inductor frames at the
    first step."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"compile_backend={backend!r} is not a torch.compile backend here; choose from {', '.join(known)}"
        )
    try:
        torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(4, device=device))
    except Exception as err:  # noqa: BLE001 - any compiler failure is reported the same way
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"--compile on, but torch.compile does not work on {device.type} here ({type(err).__name__}: "
            f"{first[:300]}); install a C/C++ compiler (inductor needs one) or run with --compile off"
        ) from None


def build_data(cfg: TrainConfig) -> TrainingData:
    """The run's shards, found and checked (the entry point builds the default corpus beforehand):
    one --data-dir, or the folders of a --data-mix."""
    if cfg.data_mix:
        entries = parse_data_mix(cfg.data_mix)
        for entry in entries:
            prepare_data(entry.path, "--data-mix")
        data: Path | list = entries
    else:
        data = prepare_data(cfg.data_dir)
    return TrainingData(
        data, cfg.seq_len, cfg.mlm_probability, cfg.seed, cfg.max_predictions_per_seq, cfg.document_attention
    )


def check_shards(data: TrainingData, run_dir: Path) -> None:
    """Hash the shards against the manifest (in parallel over the ranks, remembered per file) before
    the first batch: same-size corruption keeps token ids valid and would otherwise train silently."""
    result = verify_data(data, run_dir)
    manifests = ", ".join(str(s.data_dir / "manifest.json") for s in data.sources)  # a mix's every folder
    status.info(
        "shards verified against %s: %d files, %d hashed now (%.1f MB over all ranks), %.2f s",
        manifests, result.files, result.hashed, result.hashed_bytes / 1e6, result.seconds,
    )  # fmt: skip


def build_batches(cfg: TrainConfig, data: TrainingData, dims: ParallelDims, start: int, on_gpu: bool) -> Any:
    """This rank's training micro-batches from stream position `start`, built by `num_workers`
    DataLoader processes (forked here: after the process group, before any CUDA work of theirs)
    and pinned for asynchronous copies on a GPU."""
    workers = resolve_num_workers(cfg.num_workers)  # at most this rank's share of the CPUs
    return data.loader(start, cfg.micro_batch_size, dims.dp_rank, dims.dp_size, workers, pin_memory=on_gpu)


def total_steps(cfg: TrainConfig) -> int:
    if cfg.train_tokens is not None:
        return math.ceil(cfg.train_tokens / (cfg.global_batch_size * cfg.seq_len))
    return cfg.train_steps


def build_model_config(cfg: TrainConfig, data: TrainingData) -> SWBertConfig:
    return SWBertConfig.from_size(
        cfg.size,
        attention_type=cfg.attention_type,
        shared_bias=cfg.shared_bias,
        pad_vocab_multiple=cfg.pad_vocab_multiple,
        vocab_size=data.vocab_size,
        pad_token_id=data.special_ids.pad,
        max_position_embeddings=max(512, cfg.seq_len),
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        position_embedding=cfg.position_embedding,
        rope_theta=cfg.rope_theta,
        local_attention_window=cfg.local_attention_window,
        global_attention_every=cfg.global_attention_every,
    )


def run_record(
    cfg: TrainConfig, data: TrainingData, model_config: SWBertConfig, plan: RunPlan
) -> dict[str, Any]:
    """What every checkpoint records: the model's shape, and the settings exact resume depends on
    (a change of those is refused unless --allow-resume-change names it)."""
    return {
        "model": {
            "size": cfg.size,
            "attention_type": cfg.attention_type,
            "vocab_size": data.vocab_size,
            "hidden_size": model_config.hidden_size,
            "num_hidden_layers": model_config.num_hidden_layers,
            "tokenizer_hash": data.tokenizer_hash,
        },
        "model_config": model_config.to_dict(),
        "tensor_parallel": cfg.tensor_parallel,
        # the LR schedule's length: a resume may change it (a longer run), and says how the LR goes on
        "train_steps": total_steps(cfg),
        "run": {
            "data": data.fingerprint(),
            "seed": cfg.seed,
            "seq_len": cfg.seq_len,
            "mlm_probability": cfg.mlm_probability,
            # the masking-rate and batch-size schedules (ours; older checkpoints: none)
            "mlm_probability_final": cfg.mlm_probability_final,
            "batch_size_warmup_steps": cfg.batch_size_warmup_steps,
            "batch_size_start": cfg.batch_size_start,
            "global_batch_size": cfg.global_batch_size,
            "precision": plan.precision,
            "zero_stage": plan.zero_stage,
            "data_parallel": plan.dims.dp_size,
            "max_predictions_per_seq": data.max_predictions_per_seq,
            # which tokens a position attends to (a checkpoint without the key predates the option: off)
            "document_attention": cfg.document_attention,
            "rope_theta": cfg.rope_theta,  # context extension may raise it (--allow-resume-change rope_theta)
            # the optimizer: its kind cannot change (its state has another form); the rest is
            # applied to the restored optimizer when --allow-resume-change names it
            "optimizer": resolve_optimizer(cfg.optimizer, offloads_optimizer(plan.ds_config)),
            **{k: getattr(cfg, k) for k in OPTIMIZER_SETTINGS},
        },
        # a mix's folders, weights, manifest hashes and planned epochs (the run's "data" above is
        # what a resume checks; checkpoints add the epochs each folder went through so far)
        **({"data_mix": data.mix_record(total_steps(cfg) * cfg.global_batch_size)} if data.mixed else {}),
    }


def build_layout(cfg: TrainConfig, plan: RunPlan) -> tuple[ParallelDims, Any]:
    """Start the process group (NCCL on GPU, gloo on CPU) and the tensor-parallel groups; returns
    this process's `ParallelDims` and the DeepSpeed `mpu` (None without tensor parallelism)."""
    rank, local_rank, world = init_distributed()
    watch_for_lost_ranks()  # a dead neighbour ends the job in minutes, not a collective timeout
    set_cpu_threads(cfg.num_threads)
    if not plan.on_gpu:
        keep_freed_memory()  # no page faults for the tensors every step frees and allocates again
    if cfg.tensor_parallel == 1:
        return ParallelDims(rank, world, local_rank), None
    from swbert import parallel

    return parallel.initialize(cfg.tensor_parallel, seed=cfg.seed), parallel.mpu()


def build_model(
    cfg: TrainConfig, model_config: SWBertConfig, dims: ParallelDims, plan: RunPlan
) -> tuple[SWBertForMaskedLM, list[str]]:
    """The model every rank builds from the same seed, with the run's wrappers applied in their one
    order (`swbert.training.wrappers`: tensor parallelism, checkpointing, compile, ZeRO-3 units)
    and (CPU eager runs only) swbert.runtime.cpu's kernels swapped in; returns it and the kernels applied."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = wrap_model(
        SWBertForMaskedLM(model_config),
        tp_size=dims.tp_size,
        sequence_parallel=cfg.sequence_parallel,
        activation_checkpointing=cfg.activation_checkpointing,
        compile=plan.compile,
        compile_backend=cfg.compile_backend,
        zero_stage=plan.zero_stage,
        log_steps=dims.is_main,
    )
    # a class swap of kernel submodules (never with compile): the wrappers above are unaffected
    applied = optimize_for_cpu(model) if plan.cpu_kernels else []
    if dims.is_main:
        if applied:
            log.info("model path: CPU kernels from swbert.runtime.cpu (%s)", ", ".join(applied))
        else:
            log.info("model path: plain PyTorch ops, the path a GPU runs (no CPU kernels)")
    return model, applied


def build_engine(
    cfg: TrainConfig, model: SWBertForMaskedLM, plan: RunPlan, ds_config: dict[str, Any], mpu: Any, steps: int
) -> tuple[Any, Any, Any]:
    """AdamW and the LR schedule from the config, wrapped by `deepspeed.initialize` (the model comes
    compiled from `build_model` when asked: never through the engine, whose whole-model graph would
    hold every gradient hook until the backward ends). Returns the engine, the scheduler and, where DeepSpeed itself checks no gradient (stage 0 in
    fp32/bf16), the optimizer whose `overflow` the trainer sets to skip a step (else None)."""
    import deepspeed

    optimizer = build_optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        kind=cfg.optimizer,
        on_gpu=plan.on_gpu,
        offload=offloads_optimizer(ds_config),
    )
    # ZeRO 1-3 and fp16 check gradients for inf/NaN and skip; stage 0 in fp32/bf16 does not
    guard = skip_when_flagged(optimizer) if plan.zero_stage == 0 and plan.precision != "fp16" else None
    floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    scheduler = build_scheduler(
        optimizer, steps, cfg.warmup_steps, cfg.lr_schedule, floor, cfg.lr_decay_fraction
    )
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        mpu=mpu,
        dist_init_required=False,
    )
    from swbert.runtime.flat_grads import flatten_gradients

    flatten_gradients(engine)  # ZeRO-2 in bf16: flat gradients, no per-tensor work (docs/performance.md)
    bound_every_group()  # SWBERT_DIST_TIMEOUT_MIN for DeepSpeed's and megatron's groups too
    return engine, scheduler, guard


def skip_when_flagged(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give `optimizer` an `overflow` flag that turns its next `step` into a no-op.

    Without ZeRO and fp16, DeepSpeed steps the client optimizer itself and reads the optimizer's
    `overflow` afterwards: when set, it counts a skipped step, holds the LR schedule and zeroes the
    gradients, exactly as its ZeRO optimizers do on an overflow. The trainer sets the flag from
    its own check (a non-finite loss or gradient on any rank) before the step."""
    step = optimizer.step
    optimizer.overflow = False  # type: ignore[attr-defined]

    def guarded_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self.overflow:  # type: ignore[attr-defined]
            return None
        return step(*args, **kwargs)

    # a bound method, as the LR scheduler's step-order check wraps `optimizer.step` expecting one
    optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]
    return optimizer


def write_run_files(
    cfg: TrainConfig,
    folder: RunFolder,
    ds_config: dict[str, Any],
    is_main: bool,
    rewind_to: str | None = None,
    mix: dict[str, Any] | None = None,
) -> None:
    """Rank 0 saves the resolved config and the filled DeepSpeed config (one line names the file: the
    whole config on the console drowned what the run says), moves cut-off saves aside
    and, when resuming from an older step `rewind_to` (a rewind), the newer checkpoints; every rank
    waits. A
    `mix` (`TrainingData.mix_record`) is written below the config as comments (`mix_note`)."""
    if is_main:
        folder.output_dir.mkdir(parents=True, exist_ok=True)
        (folder.output_dir / "resolved_config.yaml").write_text(dump_config(cfg) + mix_note(mix))
        (folder.output_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        status.info(
            "resolved config (%s): size %s, %s attention, %d steps of %d x %d tokens, ZeRO-%d",
            folder.output_dir / "resolved_config.yaml", cfg.size, cfg.attention_type, total_steps(cfg),
            cfg.global_batch_size, cfg.seq_len, zero_stage(ds_config),
        )  # fmt: skip
        folder.ckpt_root.mkdir(parents=True, exist_ok=True)
        ckpt.set_aside_incomplete(folder.ckpt_root)
        if rewind_to is not None:  # resuming: a rewind is a branch, the abandoned line kept aside
            ckpt.abandon_newer(folder.ckpt_root, rewind_to)
    dist.barrier()


def mix_note(mix: dict[str, Any] | None) -> str:
    """A data mix as resolved, as YAML comments: the file stays a recipe that runs the same job."""
    if not mix:
        return ""
    lines = [f"# data_mix, resolved: every window of {mix['window']} samples draws"]
    for name, f in mix["folders"].items():
        lines.append(
            f"#   {f['per_window']} from {name} ({f['path']}, weight {f['weight']}, manifest sha256 "
            f"{f['manifest_sha256']}): {f['epochs_planned']} epochs of it over the run"
        )
    return "\n".join(lines) + "\n"


def mix_params(mix: dict[str, Any] | None) -> dict[str, Any]:
    """A data mix as resolved, as flat MLflow params: `data_mix.window`, `data_mix.<folder>.<key>`."""
    if not mix:
        return {}
    out: dict[str, Any] = {"data_mix.window": mix["window"]}
    for name, record in mix["folders"].items():
        out.update(flatten(f"data_mix.{metric_name(name)}", record))
    return out


def build_tracking(
    cfg: TrainConfig,
    folder: RunFolder,
    dims: ParallelDims,
    plan: RunPlan,
    model_config: SWBertConfig,
    applied_kernels: list[str],
    mix: dict[str, Any] | None = None,
) -> MetricsLogger | None:
    """metrics.jsonl and (with --mlflow) the MLflow run, on rank 0; None elsewhere."""
    if not dims.is_main:
        return None
    params = {
        **cfg.to_dict(),
        "world_size": dims.world,
        "dp_size": dims.dp_size,
        "grad_accum_steps": plan.batch.accum,
        "precision": plan.precision,
        "zero_stage": plan.zero_stage,
        "cpu_kernels_applied": ",".join(applied_kernels) or "none",
        "parameters": masked_lm_params(model_config),
        **flatten("deepspeed", plan.ds_config),  # the filled DeepSpeed config, as run
        **mix_params(mix),
    }
    metrics = MetricsLogger(folder.output_dir, folder.run_name, params, cfg.mlflow, cfg.system_metrics)
    metrics.artifact(folder.output_dir / "resolved_config.yaml")
    metrics.artifact(folder.output_dir / "ds_config.json")
    return metrics


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """A nested dict as `prefix.key.subkey` -> leaf value (MLflow params are flat)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten(f"{prefix}.{key}", item))
    return out
