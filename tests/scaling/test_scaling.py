"""Scaling study: closed forms against instantiated models and DeepSpeed engines; the driver end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sqlite3
import subprocess
import sys
from collections import Counter

import pytest
import torch

from swbert.models import SIZES, SWBertConfig, SWBertForMaskedLM
from swbert.models.flops import masked_lm_params
from swbert.scaling.grid import build_grid, estimate
from swbert.scaling.memory import Layout, model_state_bytes, model_tensors, params_per_rank
from tests.csv_utils import read_csv
from tests.launch_utils import REPO, job_env
from tests.model_helpers import PAPER_VARIANTS
from tests.parallel.test_parallel_harness import run_ranks


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("attention", PAPER_VARIANTS)
def test_tensor_table_matches_the_instantiated_model(size, attention):
    """Every parameter tensor of the real model, by formula: same count, same sizes."""
    config = SWBertConfig.from_size(size, attention_type=attention)
    with torch.device("meta"):
        model = SWBertForMaskedLM(config)
    real = Counter(p.numel() for p in model.parameters())  # the tied decoder weight counted once
    assert Counter(t.numel for t in model_tensors(config)) == real
    assert params_per_rank(config) == sum(p.numel() for p in model.parameters()) == masked_lm_params(config)


def test_sizes_span_tiny_to_over_a_billion():
    params = {s: params_per_rank(SWBertConfig.from_size(s, attention_type="standard")) for s in SIZES}
    assert params["base"] == 109_514_298
    assert 330e6 < params["large"] < 345e6
    assert params["xl"] >= 1e9 and params_per_rank(SWBertConfig.from_size("xl")) >= 1e9  # shared too


def test_zero_stages_shrink_memory_as_the_closed_forms_say():
    config = SWBertConfig.from_size("base", attention_type="shared")
    n, no_bucket = params_per_rank(config), {"zero_optimization": {"reduce_bucket_size": 0}}
    z = [model_state_bytes(config, Layout(zero=k), 8, "bf16", no_bucket).total for k in range(4)]
    assert z[0] == 16 * n  # 2 params + 2 grads + 4 master + 8 Adam
    assert z[1] == z[2] == pytest.approx(2 * n + 14 * n / 8)
    assert z[3] < z[2] < z[0]
    offload = model_state_bytes(config, Layout(zero=3, offload="optimizer"), 8, "bf16", no_bucket)
    assert offload.host == pytest.approx(16 * n / 8) and offload.device < z[3]
    both = model_state_bytes(config, Layout(zero=3, offload="params"), 8, "bf16", no_bucket)
    assert both.device < offload.device and both.host > offload.host
    # NVMe pays off for big models: xl on 2 ranks, with the generated configs' 100M-element sub-groups
    xl = SWBertConfig.from_size("xl", attention_type="shared")
    cpu = model_state_bytes(xl, Layout(zero=3, offload="params"), 2, "bf16")
    sub_groups = {"zero_optimization": {"sub_group_size": 10**8}}
    nvme = model_state_bytes(xl, Layout(zero=3, offload="params", device="nvme"), 2, "bf16", sub_groups)
    assert nvme.disk == cpu.host and nvme.device == cpu.device and nvme.host < cpu.host / 3


def test_layout_names_parse_and_bad_ones_are_refused():
    assert Layout.parse("tp2-z1") == Layout(tp=2, zero=1)
    assert Layout.parse("z3-offload") == Layout(zero=3, offload="optimizer")
    assert Layout.parse("z3-offload-params").name == "tp1-z3-offload-params"
    assert Layout.parse("z3-offload-params-nvme") == Layout(zero=3, offload="params", device="nvme")
    for bad, message in (
        ("z4", "not like"),
        ("z1-offload-params", "needs ZeRO stage 3"),
        ("z0-offload", "1, 2 or 3"),
    ):
        with pytest.raises(ValueError, match=message):
            Layout.parse(bad)
    with pytest.raises(ValueError, match="--sizes huge is not one of"):
        build_grid(["huge"], ["shared"], ["z1"])
    point = build_grid(["base"], ["shared"], ["tp4-z1"])[0]
    with pytest.raises(ValueError, match="vocab_size=30522"):
        estimate(point, 8)
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 4"):
        estimate(point, 6, vocab_size=30720)


def test_activation_layouts_come_from_names_and_from_the_flags():
    """--sequence-parallel and --activation-checkpointing are crossed with the layouts; a name that
    says -sp or -ac-MODE keeps its own; each layout once, and names parse back to themselves."""
    grid = build_grid(["tiny"], ["shared"], ["tp2-z1", "tp2-z2-sp"], sequence_parallel=[False, True],
                      checkpointing=["none", "full"])  # fmt: skip
    names = [p.layout.name for p in grid]
    assert names == [
        "tp2-z1",
        "tp2-z1-ac-full",
        "tp2-z1-sp",
        "tp2-z1-sp-ac-full",
        "tp2-z2-sp",
        "tp2-z2-sp-ac-full",
    ]
    assert all(Layout.parse(name).name == name for name in names)
    assert Layout.parse("z1-ac-selective") == Layout(zero=1, checkpointing="selective")
    assert Layout.parse("z3-offload-tp4-sp") == Layout(
        tp=4, zero=3, offload="optimizer", sequence_parallel=True
    )
    # the flags' defaults leave the names and points of existing command lines as they were
    assert [p.name for p in build_grid(["tiny"], ["shared"], ["z2", "tp2-z1"])] == [
        "tiny-shared-tp1-z2",
        "tiny-shared-tp2-z1",
    ]
    row = estimate(grid[3], 2, vocab_size=128)
    assert row["sequence_parallel"] is True and row["activation_checkpointing"] == "full"


@pytest.mark.parametrize(
    ("layouts", "flags", "message"),
    [
        (["z1"], {"sequence_parallel": [False, True]}, "--layouts z1: --sequence-parallel true needs a tensor-parallel size > 1"),
        (["z1-sp"], {}, "--layouts z1-sp: --sequence-parallel true needs a tensor-parallel size > 1"),
        (["z1", "tp2-z1"], {"checkpointing": ["selective"]}, "--layouts tp2-z1: --activation-checkpointing selective cannot run with tensor parallel size 2"),
        (["tp4-z2-ac-selective"], {}, "--activation-checkpointing selective cannot run with tensor parallel size 4"),
    ],
)  # fmt: skip
def test_combinations_the_trainer_refuses_are_refused_naming_the_flag(layouts, flags, message):
    with pytest.raises(ValueError, match=message):
        build_grid(["tiny"], ["shared"], layouts, **flags)


def test_the_launcher_refuses_a_bad_combination_before_anything_runs(tmp_path, capsys):
    main = runpy.run_path(str(REPO / "launchers" / "scaling_study.py"), run_name="launcher")["main"]
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as exit_:
        main(["--layouts", "z1", "tp2-z1", "--sequence-parallel", "true", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err, err
    expected = "error: --layouts z1: --sequence-parallel true needs a tensor-parallel size > 1"
    assert err.startswith(expected), err
    assert not out.exists()  # nothing ran, nothing was written


def test_measured_runs_and_job_arrays_get_the_layouts_activation_flags(tmp_path):
    """The flags reach `launchers/pretrain.py` as its config keys, and the trainer reads them back."""
    from swbert import cli
    from swbert.scaling.grid import write_ds_config
    from swbert.scaling.measure import pretrain_args
    from swbert.scaling.study import StudyConfig, emit_slurm
    from swbert.training.config import TrainConfig

    point = build_grid(["tiny"], ["shared"], ["tp2-z1-sp-ac-full"])[0]
    ds = write_ds_config(point.layout, tmp_path / "ds")
    args = pretrain_args(point, ds, tmp_path / "run", steps=3, dp=1)
    train = cli.build_config(TrainConfig, None, args)
    assert train.tensor_parallel == 2 and train.sequence_parallel is True
    assert train.activation_checkpointing == "full"
    cfg = StudyConfig(output_dir=tmp_path / "array", sizes=["tiny"], attentions=["shared"], layouts=["tp2-z1"],
                      sequence_parallel=[True], activation_checkpointing=["none", "full"], seq_len=63)  # fmt: skip
    sweep, _ = emit_slurm(cfg, nodes=1, gpus_per_node=2)
    lines = sweep.read_text().splitlines()
    # a sequence length tensor parallelism does not divide cannot be split along the sequence
    assert sum("does not divide --seq-len 63" in line for line in lines) == 2
    cfg.seq_len = 64
    sweep, _ = emit_slurm(cfg, nodes=1, gpus_per_node=2)
    runs = [line for line in sweep.read_text().splitlines() if not line.startswith("#")]
    assert [r.split("--sequence-parallel ")[1] for r in runs] == ["true --activation-checkpointing none",
                                                                  "true --activation-checkpointing full"]  # fmt: skip


def test_checkpointing_and_sequence_parallelism_let_a_point_fit():
    """The estimate that prunes layouts counts how activations are kept: a point that does not fit a
    GPU without checkpointing fits with it; sequence parallelism shrinks it at tp2."""
    from swbert.scaling.measure import GIB, Hardware

    grid = build_grid(
        ["large"], ["shared"], ["z1"], seq_len=512, micro_batch=32, checkpointing=["none", "full"]
    )
    plain, full = (estimate(p, 8, vocab_size=30720) for p in grid)
    assert full["mem_activations_gib"] < plain["mem_activations_gib"] / 5
    gpu = Hardware("cuda", 1, device_bytes=(full["mem_device_gib"] + 1) / 0.9 * GIB, host_bytes=1e12)
    assert gpu.fits(full) is None
    assert "per GPU" in gpu.fits(plain)
    sp = estimate(build_grid(["base"], ["shared"], ["tp2-z1-sp"])[0], 8, vocab_size=30720)
    tp = estimate(build_grid(["base"], ["shared"], ["tp2-z1"])[0], 8, vocab_size=30720)
    assert sp["mem_activations_gib"] < tp["mem_activations_gib"]


def test_generated_deepspeed_configs_are_filled_by_the_trainer(tmp_path):
    """Batch sizes and precision stay "auto": the trainer fills them from its own config."""
    from swbert.scaling.grid import write_ds_config
    from swbert.training.build import pretraining_ds_config
    from swbert.training.config import TrainConfig

    for layout in ("z0", "z1", "z2", "z3", "z3-offload", "z3-offload-params", "z3-offload-params-nvme"):
        path = write_ds_config(Layout.parse(layout), tmp_path / "ds", tmp_path / "swap")
        config = TrainConfig(deepspeed_config=str(path), global_batch_size=16, micro_batch_size=4)
        ds = pretraining_ds_config(config, dp_size=2, precision="bf16")
        assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 2
        assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
        assert ds["zero_optimization"]["stage"] == Layout.parse(layout).zero
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path / "swap")
    assert (tmp_path / "swap").is_dir()


def _engines_hold_what_the_closed_forms_say() -> None:
    import torch.distributed as dist

    from swbert.scaling.memory_check import measure

    # tiny (0.25M parameters): the 80K-element buckets are a third of the model, so a bucket the
    # closed form got wrong would show well above 1%; a bigger model only costs time.
    config = SWBertConfig.from_size("tiny", vocab_size=2048)
    rows = [
        measure(config, zero, precision, 80_000, 8_000) for zero in range(4) for precision in ("fp32", "bf16")
    ]
    if dist.get_rank() == 0:
        for row in rows:
            assert row["dp"] == 2
            assert abs(row["relative_error"]) < 0.01, row
        by = {(r["zero"], r["precision"]): r["measured_bytes"] for r in rows}
        assert by[(3, "fp32")] < by[(2, "fp32")] < by[(0, "fp32")]


@pytest.mark.slow
def test_closed_form_memory_matches_deepspeed_engines_within_one_percent():
    """2 ranks: the bytes a DeepSpeed engine holds after backward vs `model_state_bytes`, stages 0-3
    (what `python -m swbert.scaling.memory_check` prints; its command line is run below)."""
    run_ranks(_engines_hold_what_the_closed_forms_say, 2, deepspeed=True)


def _tensor_parallel_command_line_prints_the_closed_forms() -> None:
    """`python -m swbert.scaling.memory_check --tensor-parallel 2` in each forked rank, as a launcher
    would run it; the rows every rank printed are checked on rank 0."""
    import contextlib
    import io
    from unittest import mock

    import torch.distributed as dist

    from swbert.scaling import memory_check

    printed = io.StringIO()
    # its closing destroy_process_group is left to the harness, which still needs the group below
    with contextlib.redirect_stdout(printed), mock.patch.object(dist, "destroy_process_group"):
        memory_check.main(["--size", "tiny", "--vocab-size", "512", "--tensor-parallel", "2",
                           "--attention-type", *PAPER_VARIANTS])  # fmt: skip
    mine = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        rows = [row for rank_rows in rows for row in rank_rows]
        assert len(rows) == 2 * len(PAPER_VARIANTS)
        for row in rows:
            assert row["held"] == row["closed_form"], row


@pytest.mark.slow
def test_closed_form_tensor_parallel_shards_match_parallelized_models():
    if importlib.util.find_spec("swbert.parallel") is None:
        pytest.skip("swbert.parallel (tensor parallelism) is not in this tree")
    run_ranks(_tensor_parallel_command_line_prints_the_closed_forms, 2, deepspeed=True)


@pytest.mark.long  # CI: the same grid as a SLURM job array (test_slurm.py); the fit rule: unit tests here
def test_driver_runs_a_small_grid_end_to_end(data_dir, tmp_path_factory):
    """Tiny points measured with the real trainer; an xl point that cannot fit is skipped, not run.
    One process per point: the driver is under test here, the engines on 2 ranks above."""
    data = data_dir
    out = tmp_path_factory.mktemp("scaling") / "study"  # the MLflow store beside it
    result = subprocess.run(
        [sys.executable, "launchers/scaling_study.py", "--output-dir", str(out), "--sizes", "tiny", "xl",
         "--attention", "standard", "shared", "--layouts", "z2", "--steps", "3", "--seq-len", "64",
         "--micro-batch", "4", "--nproc", "1", "--data-dir", str(data), "--point-timeout", "600",
         "--memory-limit-gib", "8"],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = {r["name"]: r for r in read_csv(out / "scaling.csv")}
    assert set(rows) == {f"{s}-{a}-tp1-z2" for s in ("tiny", "xl") for a in ("standard", "shared")}
    for attention in ("standard", "shared"):
        tiny = rows[f"tiny-{attention}-tp1-z2"]
        assert tiny["status"] == "measured", tiny
        assert float(tiny["tokens_per_s"]) > 0 and float(tiny["loss_last"]) > 0
        assert float(tiny["peak_rss_gib"]) > 0.1
        assert int(tiny["vocab_size"]) == 96 and tiny["precision"] == "fp32"
        xl = rows[f"xl-{attention}-tp1-z2"]
        assert xl["status"] == "skipped" and "does not fit this machine" in xl["reason"], xl
        assert not (out / "points" / xl["name"]).exists()
    # shared has fewer parameters and FLOPs than standard at the same size
    assert int(rows["xl-shared-tp1-z2"]["params"]) < int(rows["xl-standard-tp1-z2"]["params"])
    for name in ("throughput.png", "memory.png", "loss.png"):
        assert (out / "plots" / name).stat().st_size > 1000
    # MLflow: one parent run and a nested run per point, with its status and the measured steps.
    db = sqlite3.connect(out.parent / "mlflow.db")
    runs = dict(db.execute("select run_uuid, name from runs").fetchall())
    parents = [r for r in runs if not db.execute(
        "select 1 from tags where run_uuid=? and key='mlflow.parentRunId'", (r,)).fetchone()]  # fmt: skip
    assert len(parents) == 1 and len(runs) == 5
    status = dict(db.execute("select r.name, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                             "where t.key = 'status'").fetchall())  # fmt: skip
    assert status == {name: rows[name]["status"] for name in rows}
    steps = db.execute("select count(*) from metrics m join runs r on r.run_uuid = m.run_uuid "
                       "where r.name = 'tiny-shared-tp1-z2' and m.key = 'loss'").fetchone()[0]  # fmt: skip
    assert steps == 3
    # the study's artifacts (the table, the plots) sit beside its store, not in ./mlruns of the cwd
    (where,) = db.execute(
        "select artifact_location from experiments where name = 'swbert-scaling'"
    ).fetchone()
    assert where == (out.parent / "mlartifacts").resolve().as_uri()
    assert len(list((out.parent / "mlartifacts").rglob("throughput.png"))) == 1


def test_memory_watchdog_stops_a_process_tree_above_its_limit(tmp_path):
    """A run that outgrows its plan is killed by the sampler, not left to the kernel's OOM killer."""
    import signal as sig

    from swbert.scaling.measure import GIB, MemorySampler

    grow = "import time; x = bytearray(400 * 2**20); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", grow], start_new_session=True)
    with MemorySampler(proc.pid, limit=0.2 * GIB, interval=0.1) as sampler:
        assert proc.wait(timeout=30) == -sig.SIGKILL
    assert sampler.exceeded is not None and sampler.exceeded > 0.2 * GIB
    assert sampler.peak_single >= 0.2 * GIB


def test_failed_points_report_the_workers_error_not_the_launchers_summary(tmp_path):
    from swbert.studies.jobs import last_error

    log = tmp_path / "run.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: AssertionError: Not enough buffers 0 for swapping 1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "launchers/pretrain.py FAILED\n"
    )
    assert last_error(log) == "AssertionError: Not enough buffers 0 for swapping 1"


def test_a_relative_output_dir_from_another_folder_reaches_the_runs_as_absolute_paths(tmp_path, monkeypatch):
    """docs/scaling.md's measured grid with `--output-dir runs/scaling-tiny`: the runs start in the
    checkout, so every path they get must name the caller's folder, not one under the checkout."""
    from pathlib import Path

    from swbert.scaling.measure import Hardware, run_point
    from swbert.scaling.study import StudyConfig
    from swbert.studies import jobs

    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    cfg = StudyConfig(output_dir=Path("runs/scaling-tiny"), data_dir="data", nvme_path=Path("swap"),
                      plugins=["my_variant.py", "pkg.variant"])  # fmt: skip
    cfg.make_absolute()
    assert cfg.output_dir == caller / "runs" / "scaling-tiny" and cfg.data_dir == str(caller / "data")
    assert cfg.nvme_path == caller / "swap" and cfg.plugins == [str(caller / "my_variant.py"), "pkg.variant"]
    started = []

    def job(cmd, log_path, timeout_s, env=None, watch=None):  # what would start, and a refusal
        started.append(cmd)
        with watch(os.getpid()):
            return jobs.JobEnd(1, "error: not run here", 0.0, log_path)

    monkeypatch.setattr(jobs, "run_job", job)
    point = build_grid(["tiny"], ["shared"], ["z2"])[0]
    m = run_point(point, Path("runs/s/ds_configs/tp1-z2.json"), Path("runs/s/points/p"), Hardware("cpu", 2, 1e12, 1e12),
                  3, "data", plugins=["my_variant.py", "pkg.variant"])  # fmt: skip
    assert m.status == "failed" and "not run here" in m.reason
    (cmd,) = started
    assert jobs.CHECKOUT == REPO != caller  # where the runs start
    for flag in ("--deepspeed-config", "--output-dir", "--data-dir", "--plugins"):
        path = Path(cmd[cmd.index(flag) + 1])
        assert path.is_absolute() and path.is_relative_to(caller), (flag, path)
    assert cmd[-1] == "pkg.variant" and cmd[cmd.index("--nproc-per-node") + 2 :][:2] == [
        "-m",
        "swbert.launchers.pretrain",
    ]


def test_a_study_whose_every_measured_run_failed_exits_non_zero(tmp_path, monkeypatch, capsys):
    import swbert.scaling.study as study

    assert study.exit_status([{"status": "failed"}, {"status": "measured"}, {"status": "skipped"}]) == 0
    assert study.exit_status([{"status": "skipped"}, {"status": "estimated"}]) == 0  # nothing was run
    monkeypatch.setattr(study, "run_study", lambda cfg: [{"status": "failed"}, {"status": "failed"}])
    main = runpy.run_path(str(REPO / "launchers" / "scaling_study.py"), run_name="launcher")["main"]
    assert main(["--output-dir", str(tmp_path), "--data-dir", str(tmp_path)]) == 3
    captured = capsys.readouterr()
    assert "2 grid point(s): 2 failed" in captured.out
    assert captured.err.startswith("error: every measured run failed") and captured.err.count("\n") == 1


def test_collect_with_nothing_run_says_so_and_where_it_looked(tmp_path, capsys):
    from swbert.scaling.study import StudyConfig, emit_slurm

    out = tmp_path / "array"
    emit_slurm(
        StudyConfig(output_dir=out, sizes=["tiny"], attentions=["standard", "shared"], layouts=["z2"]), 1, 0
    )
    main = runpy.run_path(str(REPO / "launchers" / "scaling_study.py"), run_name="launcher")["main"]
    assert main(["--collect", str(out)]) == 1
    captured = capsys.readouterr()
    assert "point(s) ->" not in captured.out
    assert (
        captured.err.startswith("nothing measured: none of the 2 point(s)")
        and str(out / "points") in captured.err
    )
    assert not (out / "scaling.csv").exists() and not (out.parent / "mlflow.db").exists()


def test_collect_imports_no_plugin_it_was_not_given(tmp_path, capsys):
    """Issue 46: a grid.json that names plugin files does not make --collect import them: only the
    user's --plugins are imported (a plugin variant's points then need them, one line says so)."""
    from swbert.scaling.study import StudyConfig, collect, emit_slurm

    marker, plugin = tmp_path / "imported", tmp_path / "plugin.py"
    plugin.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    out = tmp_path / "array"
    cfg = StudyConfig(
        output_dir=out, sizes=["tiny"], attentions=["standard"], layouts=["z2"], plugins=[str(plugin)]
    )
    emit_slurm(cfg, 1, 0)
    assert json.loads((out / "grid.json").read_text())["study"]["plugins"] == [str(plugin)]
    rows = collect(out)
    assert [r["status"] for r in rows] == ["missing"] and not marker.exists()
    main = runpy.run_path(str(REPO / "launchers" / "scaling_study.py"), run_name="launcher")["main"]
    assert main(["--collect", str(out)]) == 1 and not marker.exists()
    assert "nothing measured" in capsys.readouterr().err
    spec = json.loads((out / "grid.json").read_text())
    spec["study"]["attentions"] = ["nonesuch_variant"]  # a variant only a plugin registers
    (out / "grid.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=f"pass the grid's plugins to --collect \\(--plugins {plugin}\\)"):
        collect(out)
    assert not marker.exists()
