"""Masked-LM pretraining around `deepspeed.initialize`: the product's main job.

One code path for GPUs (NCCL, bf16) and CPUs (gloo, fp32/bf16), any ZeRO stage, optional
megatron-core tensor parallelism. Exact resume: the data position, every rank's RNG and the
optimizer/scheduler state are in each checkpoint, and masks are keyed by the global sample
position, so a resumed run repeats an uninterrupted one step for step.

`Trainer.setup` is the sequence of `swbert.training.build` steps; `Trainer.run` is the loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from swbert.logs import setup_logging, status
from swbert.models.flops import masked_lm_flops
from swbert.models.modeling import IGNORE_INDEX
from swbert.training import build
from swbert.training import checkpoint as ckpt
from swbert.training.config import TrainConfig
from swbert.training.dist import lost_ranks_named
from swbert.training.faults import nonfinite_steps
from swbert.training.metrics import device_peak_tflops, memory_gib
from swbert.training.run_tokenizer import keep_in_run

log = logging.getLogger("swbert.train")


class NonFiniteStop(RuntimeError):
    """Raised after `max_nonfinite_steps` skipped steps in a row."""


@dataclass
class Counts:
    """Sums over predicted tokens: the loss, how many were predicted, how many correctly."""

    loss_sum: float = 0.0
    predicted: float = 0.0
    correct: float = 0.0

    def __iadd__(self, other: Counts) -> Counts:
        self.loss_sum += other.loss_sum
        self.predicted += other.predicted
        self.correct += other.correct
        return self


@dataclass
class Window:
    """Running totals between two logged steps (this rank's; skipping is decided collectively)."""

    counts: Counts = field(default_factory=Counts)
    skipped: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.stop_signal: str | None = None
        self.folder: build.RunFolder | None = None
        self.faults = nonfinite_steps()  # a test hook: NaN losses at these steps

    # ---- set-up -------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        self.folder = folder = build.open_run_folder(cfg)
        self.output_dir, self.run_name, self.ckpt_root = folder.output_dir, folder.run_name, folder.ckpt_root
        plan = self.plan = build.plan_run(cfg)
        self.precision, self.ds_config = plan.precision, plan.ds_config
        self.micro_bs, self.accum = plan.batch.micro_batch, plan.batch.accum
        self.data = build.build_data(cfg)
        self.total_steps = build.total_steps(cfg)
        self.model_config = build.build_model_config(cfg, self.data)
        self.meta = build.run_record(cfg, self.data, self.model_config, plan)
        self.resume_from, self.resume_changes = build.choose_resume(cfg, self.ckpt_root, self.meta)
        # rank 0 copies the tokenizer files into <output_dir>/tokenizer; checkpoints name it relative to the run
        self.meta["tokenizer_dir"] = keep_in_run(
            self.data.tokenizer_dir, self.output_dir, self.plan.dims.is_main
        )

        self.dims, mpu = build.build_layout(cfg, plan)  # the process group starts here
        self.is_main = self.dims.is_main
        # every rank resumes from what rank 0 chose, and says so if it cannot see it
        self.resume_from = ckpt.agree_on_resume(self.resume_from)
        if self.resume_from is not None and ckpt.is_universal(self.resume_from[0] / self.resume_from[1]):
            # converted to resume at another tensor/data-parallel size
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        self.device = torch.device("cuda", self.dims.local_rank) if plan.on_gpu else torch.device("cpu")
        if plan.zero_stage == 0 and self.precision != "fp16" and self.is_main:
            log.warning(
                "ZeRO stage 0: DeepSpeed does not check gradients for NaN/inf; non-finite steps are not skipped"
            )
        model, applied = build.build_model(cfg, self.model_config, self.dims, plan.cpu_kernels)
        self.engine, self.scheduler = build.build_engine(
            cfg, model, plan, self.ds_config, mpu, self.total_steps
        )
        self.step, self.samples_consumed = 0, 0
        self.tokens_per_step = cfg.global_batch_size * cfg.seq_len
        flops = masked_lm_flops(
            self.model_config, cfg.seq_len, cfg.mlm_probability, model.last_layer_on_labels
        )
        self.train_flops_per_token = flops.training
        self.peak_tflops = device_peak_tflops() if self.precision in ("bf16", "fp16") else None

        build.write_run_files(cfg, folder, self.ds_config, self.is_main)
        self.metrics = build.build_tracking(cfg, folder, self.dims, plan, self.model_config, applied)
        if self.metrics is not None and self.resume_changes:  # deliberate changes, kept with the run
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
        status.info("resumed from %s at step %d", load_dir / tag, self.step)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signal.Signals(signum).name

    # ---- one step -----------------------------------------------------------------------------
    def _batch(self, samples_before: int, eval_split: bool = False) -> dict[str, torch.Tensor]:
        d = self.dims
        batch = self.data.batch(samples_before, self.micro_bs, d.dp_rank, d.dp_size, eval_split)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def forward_and_count(self, batch: dict[str, torch.Tensor], poison: bool = False) -> tuple[Any, Counts]:
        """The loss of one micro-batch (the head on the masked positions only, in training and in
        validation) and its counts; `poison` makes the loss NaN (fault injection)."""
        out = self.engine(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            labels=batch["labels"],
            masked_logits_only=True,
        )
        loss = out.loss * float("nan") if poison else out.loss
        target = batch["labels"][batch["labels"] != IGNORE_INDEX]
        n = target.numel()
        correct = 0.0
        if out.logits.shape[-1] == self.model_config.vocab_size:  # not a vocabulary shard (TP)
            correct = float((out.logits.detach().argmax(-1) == target).sum())
        return loss, Counts(float(loss.detach()) * n, n, correct)

    def train_step(self) -> tuple[Counts, bool]:
        """One optimizer step (accum micro-batches): this rank's counts, and whether it was applied."""
        counts = Counts()
        self.engine.train()
        for _ in range(self.accum):
            batch = self._batch(self.samples_consumed)
            self.samples_consumed += self.micro_bs * self.dims.dp_size
            loss, micro = self.forward_and_count(batch, poison=self.step + 1 in self.faults)
            counts += micro
            self.engine.backward(loss)
            self.engine.step()
        self.step += 1
        return counts, self.engine.was_step_applied()

    def _all_reduce(self, counts: Counts) -> Counts:
        t = torch.tensor(
            [counts.loss_sum, counts.predicted, counts.correct], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(t, group=self.dims.dp_group)
        return Counts(*t.tolist())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.data.has_valid:
            return {}
        self.engine.eval()
        counts = Counts()
        for i in range(self.config.eval_batches):
            counts += self.forward_and_count(self._batch(i * self.micro_bs * self.dims.dp_size, True))[1]
        total = self._all_reduce(counts)
        loss = total.loss_sum / max(total.predicted, 1)
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 50.0)),
            "val_mlm_acc": total.correct / max(total.predicted, 1),
        }

    # ---- checkpoints --------------------------------------------------------------------------
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

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_signal else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            self.setup()
        except BaseException:
            if self.folder is not None:  # a refused start leaves the folder free
                build.release(self.folder)
            raise
        loop = _Loop(self)
        status_, last_saved = "FAILED", None
        try:
            status_, last_saved = loop.run()
        finally:
            loop.close()
            if status_ != "FINISHED":
                build.release(self.folder)
                if self.metrics is not None:
                    self.metrics.close(status_)
        summary = {"step": self.step, "output_dir": str(self.output_dir), "status": status_, **loop.summary()}
        if status_ == "FINISHED":
            summary.update(self._finish(last_saved))
            build.release(self.folder)
        return summary

    def record(self, window: Window, total: Counts, skipped_total: int) -> dict[str, Any]:
        """The logged record of a window of steps (counts summed over the data-parallel ranks)."""
        elapsed = time.perf_counter() - window.started
        tokens_per_s = self.tokens_per_step * window.steps / max(elapsed, 1e-9)
        tflops = tokens_per_s * self.train_flops_per_token / self.dims.world / 1e12
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            "loss": total.loss_sum / total.predicted if total.predicted else float("nan"),
            "mlm_acc": total.correct / total.predicted if total.predicted else float("nan"),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "skipped_steps": window.skipped,
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

    # ---- the end ------------------------------------------------------------------------------
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


class _Loop:
    """The training loop of one `Trainer`: steps, skipped-step accounting, logging, saving and
    stopping on a signal. Returns the run's status and its last complete checkpoint."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.window = Window()
        self.skipped_in_a_row = self.skipped_total = 0
        self.first_logged: dict[str, Any] | None = None  # for the closing summary: did the loss fall?
        self.last_logged: dict[str, Any] | None = None
        self.bar = None
        if trainer.is_main and trainer.config.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=trainer.total_steps,
                initial=trainer.step,
                desc=f"pretrain {trainer.run_name}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )

    def run(self) -> tuple[str, Path | None]:
        t, cfg = self.t, self.t.config
        last_saved, save_pending = None, False
        while t.step < t.total_steps:
            counts, applied = t.train_step()
            self.account(counts, applied)
            if self.bar is not None:
                self.bar.update(1)
            if t.step % cfg.log_interval == 0 or t.step == t.total_steps:
                self.log_window()
            if t.step % cfg.save_interval == 0 or save_pending:
                # never checkpoint in the middle of a run of skipped steps: wait for a good one
                save_pending = not applied
                if applied:
                    last_saved = t.save()
            ckpt.fault_kill("SWBERT_FAULT_KILL_AFTER_STEP", t.step)
            if t._should_stop():
                last_saved = t._checkpoint_now(last_saved)
                status.info("pre-empted: checkpoint saved at step %d", t.step)
                return "KILLED", last_saved
        return "FINISHED", t._checkpoint_now(last_saved)

    def account(self, counts: Counts, applied: bool) -> None:
        """Add a step to the window; a skipped step counts only as skipped."""
        t, w = self.t, self.window
        w.steps += 1
        if applied:
            w.counts += counts
            self.skipped_in_a_row = 0
            return
        w.skipped += 1
        self.skipped_total += 1
        self.skipped_in_a_row += 1
        if t.is_main:
            log.warning(
                "step %d skipped: non-finite loss or gradients (%d in a row)", t.step, self.skipped_in_a_row
            )
        if self.skipped_in_a_row >= t.config.max_nonfinite_steps:
            raise NonFiniteStop(
                f"stopping at step {t.step}: {self.skipped_in_a_row} steps in a row had a non-finite loss "
                f"or gradients. The last good checkpoint is {ckpt.newest_complete(t.ckpt_root) or 'none'} "
                f"in {t.ckpt_root}; lower --lr, check the data, or raise --max-nonfinite-steps"
            )

    def log_window(self) -> None:
        t = self.t
        record = t.record(self.window, t._all_reduce(self.window.counts), self.skipped_total)
        if t.step % t.config.eval_interval == 0 or t.step == t.total_steps:
            record.update(t.evaluate())
        if t.metrics is not None:
            t.metrics.log(t.step, record)
        if math.isfinite(record["loss"]):
            self.last_logged = {"step": t.step, **record}
            self.first_logged = self.first_logged or self.last_logged
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self.window = Window()

    def summary(self) -> dict[str, Any]:
        if self.first_logged is None:
            return {}
        return {"first_logged": self.first_logged, "last_logged": self.last_logged}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
