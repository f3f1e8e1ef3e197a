"""The trainer / loop boundary: `Trainer.setup` returns one frozen `Run`; `TrainState` is exactly
what a checkpoint saves and loads; the loop acts through the trainer's public methods only; one
`resolve_resume` decides what a run continues from."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swbert.training import checkpoint as ckpt
from swbert.training.config import TrainConfig
from swbert.training.metrics import MetricsWriteError
from swbert.training.resume import Resume, resolve_resume
from swbert.training.state import Run, TrainState
from swbert.training.trainer import Trainer
from tests.launch_utils import REPO

TRAINING = REPO / "swbert" / "training"

# ---- the loop uses public methods only --------------------------------------------------------


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` as ["a", "b", "c"] (a call or subscript in the chain ends it)."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def loop_reaches_into_the_trainer(source: str) -> list[str]:
    """What `source` (loop.py) does that only the trainer should: a private attribute read or called
    on anything, or an attribute written on the trainer, its run or its state."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"line {node.lineno}: {'.'.join(_chain(node))}")
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else targets
        for target in targets:
            chain = _chain(target) if isinstance(target, ast.Attribute) else []
            if chain and (
                chain[0] in ("t", "trainer", "r", "run") or {"trainer", "state", "run"} & set(chain[1:-1])
            ):
                found.append(f"line {node.lineno}: writes {'.'.join(chain)}")
    return sorted(found, key=lambda line: int(line.split(":")[0].split()[1]))


def test_the_loop_touches_no_private_attribute_and_writes_no_trainer_counter():
    assert loop_reaches_into_the_trainer((TRAINING / "loop.py").read_text()) == []


def test_the_boundary_check_sees_what_the_loop_used_to_do():
    """The loop before the boundary: private methods called, counters set from outside."""
    old = (
        "def run(self):\n"
        "    t = self.t\n"
        "    last = t._checkpoint_now(None)\n"
        "    t.skipped_total += 1\n"
        "    t.data_wait = 0.0\n"
        "    self.trainer.state.step = 3\n"
        "    self.window.paused += 1.0\n"  # the loop's own: allowed
    )
    assert loop_reaches_into_the_trainer(old) == [
        "line 3: t._checkpoint_now",
        "line 4: writes t.skipped_total",
        "line 5: writes t.data_wait",
        "line 6: writes self.trainer.state.step",
    ]


def test_the_trainer_sets_no_attribute_outside_its_constructor():
    """Everything a method assigns on `self` is declared in `__init__`: the run is one object."""
    tree = ast.parse((TRAINING / "trainer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    set_in: dict[str, set[str]] = {}  # attribute -> the methods that assign it
    for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets = [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else targets
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        set_in.setdefault(t.attr, set()).add(method.name)
    declared = {name for name, methods in set_in.items() if "__init__" in methods}
    assert len(declared) <= 10, sorted(declared)
    assert {name: methods for name, methods in set_in.items() if name not in declared} == {}


# ---- the frozen run, the train state ----------------------------------------------------------


def _run(**given) -> Run:
    fields = {f.name: None for f in dataclasses.fields(Run)}
    return Run(**{**fields, **given})


def test_the_run_is_frozen_and_derives_its_paths_and_batch():
    folder = SimpleNamespace(output_dir=Path("out"), ckpt_root=Path("out/checkpoints"), run_name="r")
    plan = SimpleNamespace(batch=SimpleNamespace(micro_batch=4, accum=2))
    config = TrainConfig(global_batch_size=8, seq_len=64)
    run = _run(folder=folder, plan=plan, config=config, dims=SimpleNamespace(is_main=True))
    assert (run.folder.output_dir, run.folder.ckpt_root, run.folder.run_name) == (
        Path("out"),
        Path("out/checkpoints"),
        "r",
    )
    assert (run.plan.batch.micro_batch, run.plan.batch.accum, run.tokens_per_step, run.is_main) == (
        4,
        2,
        8 * 64,
        True,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.total_steps = 5  # type: ignore[misc]


# what checkpoints held as DeepSpeed's client state before TrainState, key for key
SAVED_KEYS = ["step", "samples_consumed", "sampler", "tokens_seen", "skipped_total"]


def test_the_train_state_round_trips_as_the_client_state_checkpoints_hold():
    state = TrainState(step=12, samples_consumed=96, sampler={"position": 96, "epoch": 1}, tokens_seen=6144)
    state.skipped_total = 2
    saved = state.to_dict()
    assert list(saved) == SAVED_KEYS
    assert TrainState.from_dict(saved) == state
    # DeepSpeed's load returns its own entries besides the client state: not the run's
    assert TrainState.from_dict({**saved, "ds_config": {}, "ds_version": "0.x"}) == state
    # saved before skipped steps were counted: none were
    older = {k: v for k, v in saved.items() if k != "skipped_total"}
    assert TrainState.from_dict(older).skipped_total == 0
    with pytest.raises(ValueError, match="lacks samples_consumed, step: not saved by swbert"):
        TrainState.from_dict({"sampler": {}})


def test_a_save_fills_the_data_position_and_tokens_seen():
    data = SimpleNamespace(sampler_state=lambda consumed: {"position": consumed})
    state = TrainState(step=3, samples_consumed=24)
    saved = state.at_save(data, tokens_per_step=512)
    assert saved.to_dict() == {
        "step": 3, "samples_consumed": 24, "sampler": {"position": 24}, "tokens_seen": 1536, "skipped_total": 0,
    }  # fmt: skip
    assert state.sampler == {} and state.tokens_seen == 0  # the running state is left as it was


# ---- the trainer's public methods -------------------------------------------------------------


def test_data_wait_is_read_once():
    trainer = Trainer(TrainConfig())
    trainer._data_wait = 1.5
    assert trainer.take_data_wait() == 1.5
    assert trainer.take_data_wait() == 0.0


def test_a_failed_metrics_write_is_kept_for_every_rank_to_stop_on():
    """Rank 0's write fails: no exception here (the others would wait in the next collective), the
    message is what every rank raises at the next agreement."""
    logged = []

    def log(step, record):
        logged.append((step, record))
        raise MetricsWriteError("metrics.jsonl: No space left on device")

    trainer = Trainer(TrainConfig())
    trainer.run = _run(metrics=SimpleNamespace(log=log))
    trainer.state.step = 7
    trainer.log_metrics({"loss": 1.0})
    assert logged == [(7, {"loss": 1.0})]
    assert trainer._write_failure == "metrics.jsonl: No space left on device"
    trainer.run = _run(metrics=None)  # other ranks log nothing
    trainer.log_metrics({"loss": 1.0})


def test_the_lr_and_gradient_norm_come_from_the_engine_and_schedule():
    trainer = Trainer(TrainConfig())
    norm = torch.tensor(2.5)
    trainer.run = _run(
        engine=SimpleNamespace(get_global_grad_norm=lambda: norm),
        scheduler=SimpleNamespace(get_last_lr=lambda: [3e-4, 3e-4]),
    )
    assert trainer.grad_norm() is norm and trainer.lr() == 3e-4


def test_evaluate_without_eval_batches_reads_no_data():
    assert Trainer(TrainConfig(eval_batches=0)).evaluate() == {}


# ---- one resume decision ----------------------------------------------------------------------


def _checkpoint(root: Path, step: int, meta: dict) -> Path:
    tag_dir = root / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    ckpt.mark_complete(tag_dir, step, meta)
    return tag_dir


RECORD = {"model": {"size": "tiny"}, "tensor_parallel": 1, "run": {"seed": 1, "zero_stage": 2}}


def test_resolve_resume_chooses_and_checks_before_any_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    root = tmp_path / "checkpoints"
    assert resolve_resume(TrainConfig(resume="auto"), root, RECORD) is None  # nothing yet: a fresh start
    assert resolve_resume(TrainConfig(resume="none"), root, RECORD) is None
    _checkpoint(root, 4, RECORD)
    assert resolve_resume(TrainConfig(resume="none"), root, RECORD) is None
    chosen = resolve_resume(TrainConfig(resume="auto"), root, RECORD)
    assert chosen == Resume(root, "step_00000004") and chosen.tag_dir == root / "step_00000004"
    assert not chosen.universal
    changed = {**RECORD, "run": {**RECORD["run"], "seed": 2}}
    allowed = resolve_resume(TrainConfig(resume="auto", allow_resume_change=["seed"]), root, changed)
    assert allowed is not None and allowed.changes == ("seed: 1 -> 2",)
    with pytest.raises(ValueError, match="--allow-resume-change seed"):
        resolve_resume(TrainConfig(resume="auto"), root, changed)


def test_another_tensor_parallel_size_is_refused_once_with_the_command_that_converts(tmp_path):
    """The one TP-size refusal (swbert.parallel's second one, by counting files, is gone)."""
    root = tmp_path / "checkpoints"
    tag_dir = _checkpoint(root, 4, RECORD)
    with pytest.raises(ValueError) as err:
        resolve_resume(TrainConfig(resume=str(tag_dir)), root, {**RECORD, "tensor_parallel": 2})
    message = str(err.value)
    assert "saved with --tensor-parallel 1 but this run uses 2" in message and "\n" not in message
    assert f"python -m swbert.parallel.convert universal {root} NEW_DIR --tag step_00000004" in message
    (tag_dir / "zero").mkdir()  # converted (universal): loads at any size
    resumed = resolve_resume(TrainConfig(resume=str(tag_dir)), root, {**RECORD, "tensor_parallel": 2})
    assert resumed is not None and resumed.universal
    import swbert.parallel

    assert not hasattr(swbert.parallel, "check_checkpoint")
