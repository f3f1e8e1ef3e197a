"""Masked-LM pretraining around `deepspeed.initialize`: the product's main job.

One code path for GPUs (NCCL, bf16) and CPUs (gloo, fp32/bf16), any ZeRO stage, optional
megatron-core tensor parallelism. Exact resume: the data position, every rank's RNG and the
optimizer/scheduler state are in each checkpoint, and masks are keyed by the global sample
position, so a resumed run repeats an uninterrupted one step for step.

`Trainer.setup` is the sequence of `swbert.training.build` steps and returns the frozen `Run`;
`Trainer.train` runs the loop (`swbert.training.loop`) and the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from swbert.data.mix import metric_name
from swbert.data.steps import BatchSchedule
from swbert.logs import setup_logging, status
from swbert.models import SWBertConfig
from swbert.models.flops import masked_lm_flops
from swbert.models.modeling import IGNORE_INDEX
from swbert.runtime.dist import lost_ranks_named, stop_watching
from swbert.runtime.monitor import device_peak_tflops
from swbert.runtime.optim import apply_hyperparameters, schedule_change
from swbert.runtime.ranks import ParallelDims
from swbert.runtime.run_tokenizer import keep_in_run
from swbert.training import build, checkpoint as ckpt
from swbert.training.config import TrainConfig
from swbert.training.data import TrainingData
from swbert.training.faults import kill_point, nonfinite_faults
from swbert.training.loop import Counts, Loop, StepResult
from swbert.training.metrics import MetricsWriteError
from swbert.training.resume import resolve_resume
from swbert.training.state import Run, TrainState
from swbert.training.stopping import acknowledge_at_once, acknowledgement

log = logging.getLogger("swbert.train")


class Trainer:
    """One pretraining run: `setup` builds the frozen `Run`, `train` runs the loop and the end.

    The trainer owns the run's progress (`state`, a `TrainState`: what checkpoints save and load)
    and does one step, one evaluation or one save at a time; `swbert.training.loop.Loop` decides
    when, through the public methods below."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.run: Run | None = None  # set by `setup`
        self.state = TrainState()
        self.stop_signal: str | None = None
        self._acknowledged = False  # whether a thread acknowledges stop signals (`setup`)
        self._write_failure: str | None = None  # rank 0: metrics.jsonl could not be written
        self._faults = nonfinite_faults()  # a test hook: NaN/inf losses at these steps
        self._data_wait = 0.0  # seconds the loop waited for batches, since the last read
        self._batches: Any = None  # the training loader (swbert.data.loader.BatchLoader)
        self._steps: BatchSchedule | None = None  # the global batch of each step (`setup`)

    # ---- set-up -------------------------------------------------------------------------------
    def setup(self) -> Run:
        """Build the run (`swbert.training.build`'s steps, in order) and restore a resumed
        checkpoint; returns the `Run`, also kept as `self.run`. A refused start leaves the run
        folder free."""
        # first: a SLURM time limit or torchrun shutdown during set-up (a long resume load, the
        # process group's rendezvous) is a pre-emption too, not a death by the default action;
        # the first step sees the flag on every rank and checkpoints
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # said at once, even amid a long step (the handler itself runs only when the step yields)
        self._acknowledged = acknowledge_at_once((signal.SIGUSR1, signal.SIGTERM))
        folder = build.open_run_folder(self.config)
        try:
            self.run = self._build(folder)
            self._restore()  # last: it restores the RNG streams, so nothing after it may draw from them
        except BaseException:
            build.release(folder)
            raise
        return self.run

    def _build(self, folder: build.RunFolder) -> Run:
        cfg = self.config
        plan = build.plan_run(cfg)
        data = build.build_data(cfg)
        steps = build.total_steps(cfg)
        self._schedule_batches(plan, data, steps)
        model_config = build.build_model_config(cfg, data)
        record = build.run_record(cfg, data, model_config, plan)
        # each rank alone: an incompatible checkpoint is refused here, before any process group
        resolve_resume(cfg, folder.ckpt_root, record)
        # rank 0 copies the tokenizer files into <output_dir>/tokenizer; checkpoints name it relative to the run
        record["tokenizer_dir"] = keep_in_run(data.tokenizer_dir, folder.output_dir, plan.dims.is_main)

        dims, mpu = build.build_layout(cfg, plan)  # the process group starts here
        build.check_shards(data, folder.output_dir)  # before any batch is read
        # collective: every rank resumes from what rank 0 chose, its files checked against their hashes
        resume = resolve_resume(cfg, folder.ckpt_root, record)
        if resume is not None and resume.universal:  # converted to resume at another TP/DP size
            plan.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        model, applied = build.build_model(cfg, model_config, dims, plan)
        engine, scheduler, guard = build.build_engine(cfg, model, plan, plan.ds_config, mpu, steps)
        mix = record.get("data_mix")
        build.write_run_files(cfg, folder, plan.ds_config, dims.is_main, resume and resume.tag, mix)
        metrics = build.build_tracking(cfg, folder, dims, plan, model_config, applied, mix)
        return Run(
            config=cfg, folder=folder, plan=plan, data=data, model_config=model_config, record=record,
            resume=resume, dims=dims, device=_device(plan, dims), engine=engine, scheduler=scheduler,
            guard=guard, metrics=metrics, total_steps=steps,
            train_flops_per_token=_training_flops(cfg, data, model_config, model.last_layer_on_labels),
            peak_tflops=device_peak_tflops() if plan.precision in ("bf16", "fp16") else None,
        )  # fmt: skip

    def _schedule_batches(self, plan: build.RunPlan, data: TrainingData, total_steps: int) -> None:
        """The global batch of each step (the batch-size warm-up, ours: `swbert.data.steps`) and, with
        `mlm_probability_final`, the masking rate of each sample (before the run record, which records
        the predictions per sequence it sizes)."""
        cfg, batch = self.config, plan.batch
        unit = batch.micro_batch * plan.dims.dp_size
        self._steps = BatchSchedule(
            batch.global_batch, unit, cfg.batch_size_start, cfg.batch_size_warmup_steps
        )
        if cfg.mlm_probability_final is not None:
            data.schedule_masking(cfg.mlm_probability_final, total_steps, self._steps)

    def _restore(self) -> None:
        """Load the checkpoint the run resumes from: model, optimizer, schedule, RNG and `state`."""
        run = self.run
        if run.resume is None:
            return
        self.state = TrainState.from_dict(ckpt.load(run.engine, run.resume.load_dir, run.resume.tag))
        status.info("resumed from %s at step %d", run.resume.tag_dir, self.state.step)
        for change in run.resume.changes if run.is_main else ():
            log.warning("resume changes %s (--allow-resume-change)", change)
        if run.metrics is not None and run.resume.changes:  # deliberate changes, kept with the run
            run.metrics.tag(f"resume_change.{run.resume.tag}", "; ".join(run.resume.changes))
        self._apply_optimizer_settings(run.resume.tag)
        self._say_schedule_change(run.resume.tag_dir)

    def _say_schedule_change(self, tag_dir: Path) -> None:
        """A resume with another run length follows the new LR schedule from the checkpoint's step:
        said (the LR can jump: a finished linear run had decayed to min_lr) and tagged in MLflow.
        Checkpoints that do not record their length (saved before it was) say nothing."""
        run = self.run
        saved = json.loads((tag_dir / ckpt.META).read_text()).get("train_steps")
        if saved is None or saved == run.total_steps:
            return
        cfg = self.config
        floor = cfg.min_lr / cfg.lr
        note = schedule_change(
            saved,
            run.total_steps,
            self.state.step,
            cfg.lr,
            cfg.warmup_steps,
            cfg.lr_schedule,
            floor,
            cfg.lr_decay_fraction,
        )
        if run.is_main:
            log.warning("resume changes the run's length: %s", note)
        if run.metrics is not None:
            run.metrics.tag(f"resume_schedule.{tag_dir.name}", note)

    def _apply_optimizer_settings(self, tag: str) -> None:
        """The config's optimizer settings, in effect from the first resumed step: the checkpoint
        restored the saved ones. A change was refused at start unless --allow-resume-change named
        it (checkpoints that record them); it is logged and tagged in MLflow."""
        cfg, run = self.config, self.run
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        changes = apply_hyperparameters(
            run.engine.optimizer, run.scheduler, cfg.lr, cfg.weight_decay, betas, cfg.adam_eps
        )
        if not changes:
            return
        if run.is_main:
            log.warning("resume applies %s to the restored optimizer", "; ".join(changes))
        if run.metrics is not None:
            run.metrics.tag(f"resume_applied.{tag}", "; ".join(changes))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """Checkpoint at the end of this step and stop (every rank agrees on it at the step's end).
        Ctrl-C too (torchrun forwards it once to each rank); a second Ctrl-C stops at once."""
        if signum == signal.SIGINT:
            if self.stop_signal == "SIGINT":
                raise KeyboardInterrupt
            # os.write: a handler may run while the main thread holds a logging lock
            os.write(
                2,
                b"Ctrl-C: checkpointing at the end of this step, then stopping "
                b"(Ctrl-C again stops at once, without that checkpoint)\n",
            )
        elif not self._acknowledged:
            os.write(2, acknowledgement(signum).encode())
        self.stop_signal = self.stop_signal or signal.Signals(signum).name

    # ---- one step -----------------------------------------------------------------------------
    def _batch(self, samples_before: int, valid: int | None = None) -> dict[str, torch.Tensor]:
        run = self.run
        d = run.dims
        return self._to_device(
            run.data.batch(samples_before, run.plan.batch.micro_batch, d.dp_rank, d.dp_size, valid)
        )

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the step reads, copied to the device (asynchronously from pinned memory); the
        (B, S) `labels` stay behind: the static path reads `mlm_labels`."""
        keys = ("input_ids", "attention_mask", "mlm_positions", "mlm_labels", "cu_seqlens")
        moved = {k: batch[k].to(self.run.device, non_blocking=True) for k in keys if k in batch}
        if "max_seqlen" in batch:  # with cu_seqlens (--document-attention): a host int, read on the host
            moved["max_seqlen"] = int(batch["max_seqlen"])
        return moved

    def _next_batch(self) -> dict[str, torch.Tensor]:
        """The next training micro-batch of this rank, from the loader's workers; the time the step
        loop waits for it is counted (`take_data_wait`)."""
        run = self.run
        if self._batches is None:  # started lazily: after a resume has set the stream position
            if self.config.mlm_probability_final is not None:  # the rates from the resumed step on
                anchored = self._steps.anchored(self.state.step, self.state.samples_consumed)
                run.data.schedule_masking(self.config.mlm_probability_final, run.total_steps, anchored)
            self._batches = build.build_batches(
                self.config, run.data, run.dims, self.state.samples_consumed, run.plan.on_gpu
            )
        started = time.perf_counter()
        batch = next(self._batches)
        self._data_wait += time.perf_counter() - started
        self.state.samples_consumed += run.plan.batch.micro_batch * run.dims.dp_size
        return self._to_device(batch)

    def take_data_wait(self) -> float:
        """Seconds the steps waited for batches since the last call."""
        waited, self._data_wait = self._data_wait, 0.0
        return waited

    def close_batches(self) -> None:
        """Stop the loader's workers."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def forward_and_count(
        self, batch: dict[str, torch.Tensor], poison: float | None = None
    ) -> tuple[torch.Tensor, Counts]:
        """The loss of one micro-batch (the head on the predicted positions only, in training and in
        validation) and its counts, all on the device; `poison` multiplies the loss (fault injection)."""
        inputs = {k: v for k, v in batch.items() if k != "mlm_labels"}
        inputs["mlm_targets"] = batch["mlm_labels"]  # static shapes: P predictions per sequence
        target = batch["mlm_labels"].reshape(-1)  # (B * P,), IGNORE_INDEX in the padding
        # no (N, vocab) logits: the head's chunked loss and its predicted ids (under TP too)
        out = self.run.engine(**inputs, return_logits=False)
        loss = out.loss if poison is None else out.loss * poison
        labelled = target != IGNORE_INDEX
        n = labelled.sum().double()
        correct = ((out.predictions == target) & labelled).sum().double()
        return loss, Counts(loss.detach().double() * n, n, correct)

    def train_step(self) -> StepResult:
        """One optimizer step of this step's micro-batches (fewer during a batch-size warm-up); a
        skipped one counts in `state.skipped_total`.

        The trainer, not DeepSpeed's micro-step counter, says which micro-batch ends the step
        (`set_gradient_accumulation_boundary`), and scales each micro-batch's loss by 1 / its number
        of micro-batches (DeepSpeed's own scaling divides by the configured, largest, number): the
        step's loss is the mean over its micro-batches, whatever their number. With a fixed number
        this is exactly DeepSpeed's own accounting.

        A non-finite loss on any rank turns that rank's gradients to NaN (the backward runs on
        loss x NaN), so every ZeRO stage's own check skips the step on every rank; without ZeRO, the
        trainer's guard does (`build.skip_when_flagged`). The flags are agreed in one all-reduce,
        swbert's only host sync in the step (DeepSpeed's own, and why they stay: docs/performance.md,
        "Host syncs per step"; tests/training/test_host_syncs.py holds the count)."""
        run, state = self.run, self.state
        engine, device = run.engine, run.device
        counts, bad = Counts.zeros(device), torch.zeros((), dtype=torch.bool, device=device)
        poison = self._faults.value_at(state.step + 1, run.dims.rank)
        engine.train()
        accum = self._steps.accumulation(state.step)
        for micro in range(accum):
            last = micro == accum - 1
            engine.set_gradient_accumulation_boundary(last)
            loss, micro_counts = self.forward_and_count(self._next_batch(), poison)
            counts += micro_counts
            finite = torch.isfinite(loss.detach())
            bad |= ~finite
            # x1.0 is exact; / accum is the division DeepSpeed would make with `accum` configured
            engine.backward(loss * torch.where(finite, 1.0, float("nan")) / accum, scale_wrt_gas=False)
            kill_point("in_step", state.step + 1, run.dims.rank)  # a drill: die amid the step
            if last:  # the gradients are complete (and reduced, without ZeRO)
                stop, nonfinite = self._agree(bad)
            engine.step()
        state.step += 1
        applied = engine.was_step_applied()
        if nonfinite and applied:
            raise RuntimeError(
                f"step {state.step}: a non-finite loss or gradient was found but DeepSpeed applied the update; "
                "this build of DeepSpeed skips no such step at this ZeRO stage: report it with the ds_config.json"
            )
        if not applied:
            state.skipped_total += 1
        return StepResult(counts, applied, stop)

    def _agree(self, loss_bad: torch.Tensor) -> tuple[bool, bool]:
        """Over every rank: is a stop signal pending, and is the step's loss or gradient non-finite?"""
        run = self.run
        grads_bad = torch.zeros((), device=run.device)
        flat = getattr(run.engine.optimizer, "agree_overflow", None)  # swbert.runtime.flat_grads
        if run.guard is not None:  # without ZeRO the gradients are whole (and reduced) here
            grads = [p.grad for p in run.engine.module.parameters() if p.grad is not None]
            grads_bad = (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).float()
        elif flat is not None:  # flat ZeRO-2: this rank's reduced partition, agreed below
            grads_bad = run.engine.optimizer.local_nonfinite().float()
        # torch.full, not torch.tensor: a tensor built from host data is copied to the device, and on
        # a GPU that copy waits for every kernel queued before it (a second sync in the step)
        stop = torch.full((), 1.0 if self.stop_signal else 0.0, device=run.device)
        failed = torch.full((), 1.0 if self._write_failure else 0.0, device=run.device)
        flags = torch.stack([stop, loss_bad.float(), grads_bad.to(run.device), failed])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop_any, loss_any, grads_any, failed_any = (v > 0 for v in flags.tolist())
        if failed_any:
            message = [self._write_failure]
            dist.broadcast_object_list(message, src=0)  # rank 0 writes metrics.jsonl
            self._raise_write_failure(message[0])
        if run.guard is not None:
            run.guard.overflow = loss_any or grads_any
        if flat is not None:  # its step skips or applies on this, with no check or sync of its own
            flat(loss_any or grads_any)
        return stop_any, loss_any or grads_any

    def _raise_write_failure(self, message: str) -> None:
        """Every rank raises rank 0's message (a full disk between saves) at the same point, before
        an update or the last checkpoint, instead of rank 0 dying alone and the others naming it
        as lost."""
        newest = ckpt.newest_complete(self.run.folder.ckpt_root)
        raise MetricsWriteError(
            f"stopping after step {self.state.step} on every rank: {message}. Free space there, then "
            f"restart with --resume auto: it continues from {newest or 'step 0'}"
        )

    def reduce_counts(self, counts: Counts, also: torch.Tensor | None = None) -> list[float]:
        """Counts summed over the data-parallel ranks, read on the host (log intervals only) in one
        read together with `also` (a device scalar the same on every rank, e.g. the gradient norm)."""
        t = torch.stack([counts.loss_sum, counts.predicted, counts.correct])
        dist.all_reduce(t, group=self.run.dims.dp_group)
        if also is not None:
            t = torch.cat([t, also.detach().reshape(1).to(t)])
        return t.tolist()

    def grad_norm(self) -> torch.Tensor | float | None:
        """The last step's gradient norm: a device tensor under ZeRO, a float or None otherwise."""
        return self.run.engine.get_global_grad_norm()

    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.run.scheduler.get_last_lr()[0]

    def log_metrics(self, record: dict[str, Any]) -> None:
        """Log a step's record (rank 0: metrics.jsonl, MLflow). A write that fails stops every rank
        at the next step's agreement (`_agree`), instead of rank 0 alone."""
        if self.run.metrics is None:
            return
        try:
            self.run.metrics.log(self.state.step, record)
        except MetricsWriteError as err:
            self._write_failure = str(err)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss, perplexity and accuracy; nothing without a validation split or with
        `eval_batches` 0 (a loss over no tokens would read 0.0, perplexity 1.0).

        A mix evaluates `eval_batches` micro-batches of each folder's own validation split and
        reports each (`val_loss/<folder>`, `val_mlm_acc/<folder>`); the overall `val_loss` and
        `val_mlm_acc` are the means over the folders weighted by the mix (ours: the loss of the
        distribution the run trains on), renormalised over the folders that have a split."""
        if self.config.eval_batches == 0 or not self.run.data.has_valid:
            return {}
        data = self.run.data
        self.run.engine.eval()
        per_folder = {k: self._evaluate_folder(k) for k in data.valid_sources()}
        out: dict[str, float] = {}
        if data.mixed:
            for k, (loss, acc) in per_folder.items():
                name = metric_name(data.names[k])
                out[f"val_loss/{name}"], out[f"val_mlm_acc/{name}"] = loss, acc
        weights = {k: float(data.sources[k].weight) for k in per_folder}
        total = sum(weights.values())
        loss = sum(weights[k] * per_folder[k][0] for k in per_folder) / total
        acc = sum(weights[k] * per_folder[k][1] for k in per_folder) / total
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_mlm_acc": acc, **out}

    def _evaluate_folder(self, source: int) -> tuple[float, float]:
        """(loss, accuracy) over `eval_batches` micro-batches of folder `source`'s validation split."""
        run = self.run
        counts = Counts.zeros(run.device)
        for i in range(self.config.eval_batches):
            counts += self.forward_and_count(
                self._batch(i * run.plan.batch.micro_batch * run.dims.dp_size, valid=source)
            )[1]
        loss_sum, predicted, correct = self.reduce_counts(counts)
        return loss_sum / max(predicted, 1), correct / max(predicted, 1)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint this step (collective): the engine's states, every rank's RNG and `state`."""
        run = self.run
        saved = self.state.at_save(run.data, run.tokens_per_step)
        # the tokens of the steps taken (a batch-size warm-up's steps are smaller)
        saved = replace(saved, tokens_seen=saved.samples_consumed * self.config.seq_len)
        meta = {**run.record, "step": saved.step}
        if run.data.mixed:  # the epochs each folder went through, recorded with the mix
            meta["data_position"] = saved.sampler
        return ckpt.save(
            run.engine, run.folder.ckpt_root, saved.step, saved.to_dict(), meta, self.config.keep_checkpoints
        )

    def checkpoint_now(self, last_saved: Path | None) -> Path:
        """A complete checkpoint of the current step: the one already on disk (a finished run that
        is resumed again, or a save this run just made) is never rewritten. Rank 0 decides."""
        run = self.run
        tag_dir = run.folder.ckpt_root / ckpt.tag_for(self.state.step)
        # with it, a failed write of the last logged step, which had no next step to agree in
        decision = [last_saved == tag_dir or (run.is_main and ckpt.is_complete(tag_dir)), self._write_failure]
        dist.broadcast_object_list(decision, src=0)
        if decision[1]:
            self._raise_write_failure(decision[1])
        return tag_dir if decision[0] else self.save()

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Set up, run the loop, and at the end export and close; returns the run's summary."""
        run = self.setup()
        loop = Loop(self)
        status_, last_saved = "FAILED", None
        try:
            status_, last_saved = loop.run()
        finally:
            stop_watching()  # from here on, ranks may leave at their own pace
            loop.close()
            self.close_batches()
            if status_ != "FINISHED":
                build.release(run.folder)
                if run.metrics is not None:
                    run.metrics.close(status_)
        summary = {
            "step": self.state.step,
            "output_dir": str(run.folder.output_dir),
            "status": status_,
            "is_main": run.is_main,  # rank 0 prints the closing summary
            **loop.summary(),
        }
        if status_ == "FINISHED":
            summary.update(self._finish(last_saved))
            build.release(run.folder)
        return summary

    # ---- the end ------------------------------------------------------------------------------
    def _export(self, tag_dir: Path) -> Path:
        """`<output_dir>/export` from `tag_dir`, written next to it and renamed into place, so a kill
        leaves either the previous folder or the new one; skipped when it already holds `tag_dir`:
        the same step saved by the same save (the marker's hash), not a namesake a rewind abandoned."""
        from swbert.training.export import export_into_place

        def drill() -> None:  # a drill: the new folder written, not in place
            kill_point("in_export", self.state.step, self.run.dims.rank)

        return export_into_place(tag_dir, self.run.folder.output_dir / "export", drill)

    def export_if_due(self, tag_dir: Path) -> None:
        """With --export-every N, rank 0 exports the checkpoint just saved (`tag_dir`) when due to
        `exports/<tag>/` in the run folder, and tags the MLflow run with its path (ours)."""
        from swbert.training.export import EXPORTS_DIR, export_due, export_into_place

        cfg = self.config
        if self.run.is_main and export_due(self.state.step, cfg.export_every, cfg.save_interval):
            path = export_into_place(tag_dir, self.run.folder.output_dir / EXPORTS_DIR / tag_dir.name)
            status.info("step %d exported to %s", self.state.step, path)
            if self.run.metrics is not None:
                self.run.metrics.tag(f"{EXPORTS_DIR}/{tag_dir.name}", str(path.resolve()))

    def _finish(self, last_saved: Path | None) -> dict[str, Any]:
        """Export the final weights to a Hugging Face folder and close the MLflow run (rank 0)."""
        out: dict[str, Any] = {}
        metrics = self.run.metrics
        if self.run.is_main and self.config.export and last_saved is not None:
            export_dir = self._export(last_saved)
            out["export_dir"] = str(export_dir)
            if metrics is not None:
                # an MLflow model (runs:/<run id>/model, for mlflow.pyfunc.load_model) that holds the
                # folder itself, under model/artifacts/
                metrics.log_model(export_dir)
        if metrics is not None:
            metrics.close("FINISHED")
            if metrics.mlflow is not None:
                out["mlflow_uri"] = metrics.mlflow.uri
        dist.barrier()
        return out


def _device(plan: build.RunPlan, dims: ParallelDims) -> torch.device:
    return torch.device("cuda", dims.local_rank) if plan.on_gpu else torch.device("cpu")


def _training_flops(
    cfg: TrainConfig, data: TrainingData, model_config: SWBertConfig, last_layer_on_labels: bool
) -> float:
    """Training FLOPs per token: the head and the last layer run on P positions per sequence
    (padding included)."""
    predicted = data.max_predictions_per_seq / cfg.seq_len
    return masked_lm_flops(model_config, cfg.seq_len, predicted, last_layer_on_labels).training


def run(config: TrainConfig) -> dict[str, Any]:
    """Run pretraining; every rank calls this. Returns a summary (paths on rank 0)."""
    setup_logging()
    trainer = Trainer(config)
    try:
        with lost_ranks_named():  # a collective failed by a dead or hung rank names that rank
            return trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
