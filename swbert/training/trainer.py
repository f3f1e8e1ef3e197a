"""Masked-LM pretraining around `deepspeed.initialize`: the product's main job.

One code path for GPUs (NCCL, bf16) and CPUs (gloo, fp32/bf16), any ZeRO stage, optional
megatron-core tensor parallelism. Exact resume: the data position, every rank's RNG and the
optimizer/scheduler state are in each checkpoint, and masks are keyed by the global sample
position, so a resumed run repeats an uninterrupted one step for step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from swbert.cpu import keep_freed_memory, optimize_for_cpu, resolve_cpu_kernels, set_cpu_threads
from swbert.models import SWBertConfig, SWBertForMaskedLM
from swbert.models.flops import masked_lm_flops, masked_lm_params
from swbert.training import checkpoint as ckpt
from swbert.training.config import TrainConfig, dump_config
from swbert.training.data import TrainingData, prepare_data
from swbert.training.dist import bound_every_group, init_distributed, lost_ranks_named, map_launcher_env
from swbert.training.ds_config import build_ds_config, offloads_optimizer, resolve_precision, zero_stage
from swbert.training.metrics import MetricsLogger, device_peak_tflops, memory_gib
from swbert.training.optim import build_optimizer, build_scheduler
from swbert.training.run_tokenizer import keep_in_run
from swbert.training.runlock import RunLock

log = logging.getLogger("swbert.train")


class NonFiniteStop(RuntimeError):
    """Raised after `max_nonfinite_steps` skipped steps in a row."""


@dataclass
class Layout:
    """Who this process is: global rank, and its place in the tensor/data-parallel grid."""

    rank: int
    world: int
    tp_size: int
    dp_size: int
    dp_rank: int
    dp_group: Any = None  # None: the whole world


def build_layout(config: TrainConfig, rank: int, world: int) -> tuple[Layout, Any]:
    """Tensor-parallel groups from megatron-core when tp > 1 (returns the DeepSpeed mpu too)."""
    tp = config.tensor_parallel
    if tp == 1:
        return Layout(rank, world, 1, world, rank), None
    from swbert import parallel

    dims = parallel.initialize(tp, seed=config.seed)
    return Layout(rank, world, tp, dims.dp_size, dims.dp_rank, dims.dp_group), parallel.mpu()


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.stop_signal: str | None = None
        self.lock: RunLock | None = None

    # ---- set-up -------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        self.output_dir = Path(cfg.output_dir or f"runs/{cfg.size}-{cfg.attention_type}")
        self.run_name = cfg.run_name or f"{cfg.size}-{cfg.attention_type}"
        self.ckpt_root = self.output_dir / "checkpoints"
        # Everything that can be wrong with the request is checked before the process group
        # starts, so a bad flag fails at once on every rank instead of hanging a collective.
        map_launcher_env()
        if os.environ["RANK"] == "0":  # one job per run folder: refused at once if another holds it
            self.lock = RunLock(self.output_dir).acquire()
        if cfg.resume == "none" and ckpt.newest_complete(self.ckpt_root):
            raise ValueError(
                f"{self.output_dir} already holds a run with checkpoints; pass --resume auto to continue it, "
                "or choose a new --output-dir"
            )
        world = int(os.environ["WORLD_SIZE"])
        if world % cfg.tensor_parallel != 0:
            raise ValueError(
                f"world size {world} is not divisible by --tensor-parallel {cfg.tensor_parallel}; "
                f"launch a multiple of {cfg.tensor_parallel} ranks"
            )
        dp_size = world // cfg.tensor_parallel
        self.on_gpu = torch.cuda.is_available()
        self.precision = resolve_precision(cfg.precision, self.on_gpu)
        self.cpu_kernels = resolve_cpu_kernels(cfg.cpu_kernels, self.on_gpu, cfg.compile)
        self.ds_config = build_ds_config(cfg, dp_size, self.precision)
        _, self.micro_bs, self.accum = cfg.batch_layout(dp_size)
        data_dir = prepare_data(cfg.data_dir, self.output_dir)
        self.data = TrainingData(data_dir, cfg.seq_len, cfg.mlm_probability, cfg.seed)
        self.total_steps = cfg.train_steps
        if cfg.train_tokens is not None:
            self.total_steps = math.ceil(cfg.train_tokens / (cfg.global_batch_size * cfg.seq_len))
        self.model_config = SWBertConfig.from_size(
            cfg.size,
            attention_type=cfg.attention_type,
            vocab_size=self.data.vocab_size,
            max_position_embeddings=max(512, cfg.seq_len),
            hidden_dropout_prob=cfg.hidden_dropout,
            attention_probs_dropout_prob=cfg.attention_dropout,
        )
        self.meta = {
            "model": {
                "size": cfg.size,
                "attention_type": cfg.attention_type,
                "vocab_size": self.data.vocab_size,
                "hidden_size": self.model_config.hidden_size,
                "num_hidden_layers": self.model_config.num_hidden_layers,
                "tokenizer_hash": self.data.tokenizer_hash,
            },
            "model_config": self.model_config.to_dict(),
            "tensor_parallel": cfg.tensor_parallel,
            # what exact resume depends on: a change is refused unless --allow-resume-change names it
            "run": {
                "data": hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest()[:16],
                "seed": cfg.seed,
                "seq_len": cfg.seq_len,
                "mlm_probability": cfg.mlm_probability,
                "global_batch_size": cfg.global_batch_size,
                "precision": self.precision,
                "zero_stage": zero_stage(self.ds_config),
                "data_parallel": dp_size,
            },
        }
        self.resume_changes: list[str] = []
        self.resume_from = ckpt.resolve_resume(cfg.resume, self.ckpt_root)
        if self.resume_from is None and cfg.resume not in ("none", "auto"):
            raise FileNotFoundError(f"--resume {cfg.resume}: nothing to resume from")
        if self.resume_from is not None:
            tag_dir = self.resume_from[0] / self.resume_from[1]
            self.resume_changes = ckpt.check_compatible(tag_dir, self.meta, cfg.allow_resume_change)
        # rank 0 copies the tokenizer files into <output_dir>/tokenizer; checkpoints name it relative to the run
        self.meta["tokenizer_dir"] = keep_in_run(
            self.data.tokenizer_dir, self.output_dir, os.environ["RANK"] == "0"
        )

        rank, self.local_rank, world = init_distributed()
        # every rank resumes from what rank 0 chose, and says so if it cannot see it
        self.resume_from = ckpt.agree_on_resume(self.resume_from)
        if self.resume_from is not None and ckpt.is_universal(self.resume_from[0] / self.resume_from[1]):
            # converted to resume at another tensor/data-parallel size
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        set_cpu_threads(cfg.num_threads)
        if not self.on_gpu:
            keep_freed_memory()  # no page faults for the tensors every step frees and allocates again
        self.device = torch.device("cuda", self.local_rank) if self.on_gpu else torch.device("cpu")
        self.layout, mpu = build_layout(cfg, rank, world)
        self.is_main = rank == 0
        if zero_stage(self.ds_config) == 0 and self.precision != "fp16" and self.is_main:
            log.warning(
                "ZeRO stage 0: DeepSpeed does not check gradients for NaN/inf; non-finite steps are not skipped"
            )
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = SWBertForMaskedLM(self.model_config)
        if self.layout.tp_size > 1:
            from swbert import parallel

            model = parallel.parallelize(model, self.layout.tp_size)
        # after tensor parallelism (it swaps only PyTorch's own modules), before the engine wraps it
        self.applied_cpu_kernels = optimize_for_cpu(model) if self.cpu_kernels else []
        if self.is_main:
            if self.applied_cpu_kernels:
                log.info("model path: CPU kernels from swbert.cpu (%s)", ", ".join(self.applied_cpu_kernels))
            else:
                log.info("model path: plain PyTorch ops, the path a GPU runs (no CPU kernels)")
        optimizer = build_optimizer(model, cfg, self.on_gpu, offloads_optimizer(self.ds_config))
        scheduler = build_scheduler(optimizer, cfg, self.total_steps)

        import deepspeed

        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=self.ds_config,
            mpu=mpu,
            dist_init_required=False,
        )
        bound_every_group()  # SWBERT_DIST_TIMEOUT_MIN for DeepSpeed's and megatron's groups too
        if cfg.compile:  # in place: parameter names, checkpoints and exports stay those of the eager model
            self.engine.compile()
        self.step, self.samples_consumed = 0, 0
        self.tokens_per_step = cfg.global_batch_size * cfg.seq_len
        flops = masked_lm_flops(
            self.model_config, cfg.seq_len, cfg.mlm_probability, model.last_layer_on_labels
        )
        self.train_flops_per_token = flops.training
        self.peak_tflops = device_peak_tflops() if self.precision in ("bf16", "fp16") else None

        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "resolved_config.yaml").write_text(dump_config(cfg))
            (self.output_dir / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")
            print(
                f"resolved config ({self.output_dir / 'resolved_config.yaml'}):\n{dump_config(cfg)}",
                flush=True,
            )
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            ckpt.set_aside_incomplete(self.ckpt_root)
        dist.barrier()
        self.metrics = None
        if self.is_main:
            params = {
                **cfg.to_dict(),
                "world_size": self.layout.world,
                "dp_size": self.layout.dp_size,
                "grad_accum_steps": self.accum,
                "precision": self.precision,
                "zero_stage": zero_stage(self.ds_config),
                "cpu_kernels_applied": ",".join(self.applied_cpu_kernels) or "none",
                "parameters": masked_lm_params(self.model_config),
            }
            params.update(flatten("deepspeed", self.ds_config))  # the filled DeepSpeed config, as run
            self.metrics = MetricsLogger(
                self.output_dir, self.run_name, params, cfg.mlflow, cfg.system_metrics
            )
            self.metrics.artifact(self.output_dir / "resolved_config.yaml")
            self.metrics.artifact(self.output_dir / "ds_config.json")
            if self.resume_changes:  # deliberate changes at a resume, kept with the run
                self.metrics.tag(f"resume_change.{self.resume_from[1]}", "; ".join(self.resume_changes))
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._maybe_resume()  # last: it restores the RNG streams, so nothing after it may draw from them

    def _maybe_resume(self) -> None:
        if self.resume_from is None:
            return
        load_dir, tag = self.resume_from
        state = ckpt.load(self.engine, load_dir, tag)
        self.step, self.samples_consumed = state["step"], state["samples_consumed"]
        if self.is_main:
            print(f"resumed from {load_dir / tag} at step {self.step}", flush=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signal.Signals(signum).name

    # ---- the loop -----------------------------------------------------------------------------
    def _batch(self, samples_before: int, eval_split: bool = False) -> dict[str, torch.Tensor]:
        lay = self.layout
        batch = self.data.batch(samples_before, self.micro_bs, lay.dp_rank, lay.dp_size, eval_split)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _all_reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.layout.dp_group)
        return t.tolist()

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_signal else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def train_step(self) -> tuple[float, float, float, bool]:
        """One optimizer step (accum micro-batches). Returns local (loss sum, predicted, correct, applied)."""
        cfg = self.config
        loss_sum = predicted = correct = 0.0
        self.engine.train()
        for _ in range(self.accum):
            batch = self._batch(self.samples_consumed)
            self.samples_consumed += self.micro_bs * self.layout.dp_size
            out = self.engine(
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                labels=batch["labels"],
                masked_logits_only=True,  # validation too: the head on the masked positions only
            )
            loss = out.loss
            if self.step + 1 in cfg.fault_nonfinite_steps:
                loss = loss * float("nan")  # fault injection for tests and drills
            n = int((batch["labels"] != -100).sum())
            loss_sum += float(loss.detach()) * n
            predicted += n
            if out.logits.shape[-1] == self.model_config.vocab_size:
                target = batch["labels"][batch["labels"] != -100]
                correct += float((out.logits.detach().argmax(-1) == target).sum())
            self.engine.backward(loss)
            self.engine.step()
        self.step += 1
        return loss_sum, predicted, correct, self.engine.was_step_applied()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.data.has_valid:
            return {}
        self.engine.eval()
        loss_sum = predicted = correct = 0.0
        for i in range(self.config.eval_batches):
            batch = self._batch(i * self.micro_bs * self.layout.dp_size, eval_split=True)
            out = self.engine(
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                labels=batch["labels"],
                masked_logits_only=True,  # validation too: the head on the masked positions only
            )
            n = int((batch["labels"] != -100).sum())
            loss_sum += float(out.loss) * n
            predicted += n
            if out.logits.shape[-1] == self.model_config.vocab_size:
                correct += float((out.logits.argmax(-1) == batch["labels"][batch["labels"] != -100]).sum())
        loss_sum, predicted, correct = self._all_reduce([loss_sum, predicted, correct])
        loss = loss_sum / max(predicted, 1)
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 50.0)),
            "val_mlm_acc": correct / max(predicted, 1),
        }

    def save(self) -> Path:
        client_state = {
            "step": self.step,
            "samples_consumed": self.samples_consumed,
            "sampler": self.data.sampler_state(self.samples_consumed),
            "tokens_seen": self.step * self.tokens_per_step,
        }
        meta = {**self.meta, "step": self.step}
        return ckpt.save(
            self.engine, self.ckpt_root, self.step, client_state, meta, self.config.keep_checkpoints
        )

    def _checkpoint_now(self, last_saved: Path | None) -> Path:
        """A complete checkpoint of the current step: the one already on disk (a finished run that
        is resumed again, or a save this run just made) is never rewritten. Rank 0 decides."""
        tag_dir = self.ckpt_root / ckpt.tag_for(self.step)
        decision = [last_saved == tag_dir or (self.is_main and ckpt.is_complete(tag_dir))]
        dist.broadcast_object_list(decision, src=0)
        return tag_dir if decision[0] else self.save()

    def run(self) -> dict[str, Any]:
        cfg = self.config
        try:
            self.setup()
        except BaseException:
            if self.lock is not None:  # a refused start leaves the folder free
                self.lock.release()
            raise
        bar = None
        if self.is_main and cfg.progress_bar:
            from tqdm import tqdm

            bar = tqdm(
                total=self.total_steps,
                initial=self.step,
                desc=f"pretrain {self.run_name}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )
        window = [0.0, 0.0, 0.0, 0.0]  # loss sum, predicted, correct, skipped
        skipped_in_a_row, skipped_total = 0, 0
        t_window, steps_in_window = time.perf_counter(), 0
        status, last_saved, save_pending = "FINISHED", None, False
        first_logged: dict[str, Any] | None = None  # for the closing summary: did the loss fall?
        last_logged: dict[str, Any] | None = None
        try:
            while self.step < self.total_steps:
                loss_sum, predicted, correct, applied = self.train_step()
                steps_in_window += 1
                window[0] += loss_sum if applied else 0.0
                window[1] += predicted if applied else 0.0
                window[2] += correct if applied else 0.0
                if not applied:
                    window[3] += 1
                    skipped_total += 1
                    skipped_in_a_row += 1
                    if self.is_main:
                        log.warning(
                            "step %d skipped: non-finite loss or gradients (%d in a row)",
                            self.step,
                            skipped_in_a_row,
                        )
                    if skipped_in_a_row >= cfg.max_nonfinite_steps:
                        raise NonFiniteStop(
                            f"stopping at step {self.step}: {skipped_in_a_row} steps in a row had a non-finite loss "
                            f"or gradients. The last good checkpoint is {ckpt.newest_complete(self.ckpt_root) or 'none'} "
                            f"in {self.ckpt_root}; lower --lr, check the data, or raise --max-nonfinite-steps"
                        )
                else:
                    skipped_in_a_row = 0
                if bar is not None:
                    bar.update(1)
                if self.step % cfg.log_interval == 0 or self.step == self.total_steps:
                    loss_sum_g, pred_g, corr_g = self._all_reduce(window[:3])
                    elapsed = time.perf_counter() - t_window
                    # skipping is decided collectively, so the local count is everyone's
                    record = self._record(
                        loss_sum_g, pred_g, corr_g, window[3], skipped_total, steps_in_window, elapsed
                    )
                    if self.step % cfg.eval_interval == 0 or self.step == self.total_steps:
                        record.update(self.evaluate())
                    if self.metrics is not None:
                        self.metrics.log(self.step, record)
                    if math.isfinite(record["loss"]):
                        last_logged = {"step": self.step, **record}
                        first_logged = first_logged or last_logged
                    if bar is not None:
                        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                    window = [0.0, 0.0, 0.0, 0.0]
                    t_window, steps_in_window = time.perf_counter(), 0
                if self.step % cfg.save_interval == 0 or save_pending:
                    # never checkpoint in the middle of a run of skipped steps: wait for a good one
                    save_pending = not applied
                    if applied:
                        last_saved = self.save()
                ckpt.fault_kill("SWBERT_FAULT_KILL_AFTER_STEP", self.step)
                if self._should_stop():
                    last_saved = self._checkpoint_now(last_saved)
                    if self.is_main:
                        print(f"pre-empted: checkpoint saved at step {self.step}", flush=True)
                    status = "KILLED"
                    break
            if status == "FINISHED":
                last_saved = self._checkpoint_now(last_saved)
        except BaseException:
            status = "FAILED"
            raise
        finally:
            if bar is not None:
                bar.close()
            if self.lock is not None and status != "FINISHED":
                self.lock.release()
            if self.metrics is not None and status != "FINISHED":
                self.metrics.close(status)
        summary = {"step": self.step, "output_dir": str(self.output_dir), "status": status}
        if first_logged is not None:
            summary.update(first_logged=first_logged, last_logged=last_logged)
        if status == "FINISHED":
            summary.update(self._finish(last_saved))
            if self.lock is not None:
                self.lock.release()
        return summary

    def _record(
        self,
        loss_sum: float,
        predicted: float,
        correct: float,
        skipped: float,
        skipped_total: int,
        steps: int,
        elapsed: float,
    ) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step * steps / max(elapsed, 1e-9)
        tflops = tokens_per_s * self.train_flops_per_token / self.layout.world / 1e12
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            "loss": loss_sum / predicted if predicted else float("nan"),
            "mlm_acc": correct / predicted if predicted else float("nan"),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "skipped_steps": int(skipped),
            "skipped_total": skipped_total,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": tokens_per_s / self.config.seq_len,
            "tflops_per_device": tflops,
            "tokens_seen": self.step * self.tokens_per_step,
            **memory_gib(),
        }
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        return record

    def _export(self, tag_dir: Path) -> Path:
        """`<output_dir>/export` from `tag_dir`, written next to it and renamed into place, so a kill
        leaves either the previous folder or the new one; skipped when it already holds `tag_dir`."""
        from swbert.training.export import export

        final = self.output_dir / "export"
        stamp, source = final / "swbert_export.json", {"checkpoint": tag_dir.name}
        try:
            if json.loads(stamp.read_text()) == source:
                log.info("%s already holds %s", final, tag_dir.name)
                return final
        except (OSError, ValueError):
            pass  # missing, or from an export that did not finish: write it again
        staging, old = self.output_dir / ".export.tmp", self.output_dir / ".export.old"
        for leftover in (staging, old):
            shutil.rmtree(leftover, ignore_errors=True)
        export(tag_dir, staging)
        (staging / stamp.name).write_text(json.dumps(source))
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    def _finish(self, last_saved: Path | None) -> dict[str, Any]:
        """Export the final weights to a Hugging Face folder and close the MLflow run (rank 0)."""
        out: dict[str, Any] = {}
        if self.is_main and self.config.export and last_saved is not None:
            export_dir = self._export(last_saved)
            out["export_dir"] = str(export_dir)
            if self.metrics is not None:
                # an MLflow model (runs:/<run id>/model, for mlflow.pyfunc.load_model) that holds the
                # folder itself, under model/artifacts/
                self.metrics.log_model(export_dir)
        if self.metrics is not None:
            self.metrics.close("FINISHED")
            if self.metrics.mlflow is not None:
                out["mlflow_uri"] = self.metrics.mlflow.uri
        dist.barrier()
        return out


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """A nested dict as `prefix.key.subkey` -> leaf value (MLflow params are flat)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten(f"{prefix}.{key}", item))
    return out


def setup_logging() -> None:
    """INFO on rank 0, warnings elsewhere; the libraries' per-shard chatter off."""
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("megatron", "mlflow.store.db.utils", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # per-shard index logs drown the progress


def run(config: TrainConfig) -> dict[str, Any]:
    """Run pretraining; every rank calls this. Returns a summary (paths on rank 0)."""
    setup_logging()
    trainer = Trainer(config)
    try:
        with lost_ranks_named():  # a collective failed by a dead or hung rank names that rank
            return trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
