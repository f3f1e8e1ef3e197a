"""The package as users install it: a wheel in a fresh environment, run from a folder outside the repository.

The environment reuses this one's installed dependencies (a .pth line to its site-packages; .pth
files inside that folder, such as the editable install of swbert, are not processed), so nothing is
downloaded; swbert itself comes only from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.launch_utils import HANG_S, REPO, job_env

# top-level folders of a checkout that are not part of the source (runs, caches, environments)
NOT_SOURCE = {".git", ".venv", "runs", "data", "build", "dist", ".pytest_cache", ".ruff_cache", "mlruns"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    top = Path(folder).resolve() == REPO
    return {n for n in names if (top and n in NOT_SOURCE) or n == "__pycache__" or n.endswith(".egg-info")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh virtual environment holding swbert from its wheel (non-editable)."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_ignore)  # build from a copy: the checkout stays untouched
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            root / "dist",
            source,
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (root / "dist").glob("swbert-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ["zero2.json", "zero3_offload.json"]:
        assert f"swbert/ds_configs/{shipped}" in names
    assert {"swbert/recipes/tiny_cpu.yaml", "swbert/launchers/finetune_glue.py"} <= set(names)

    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    (purelib / "_project_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            env_dir / "bin" / "python",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            wheel,
        ],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    return env_dir / "bin"


def outside_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """The job environment minus the repository on PYTHONPATH, with the new environment's scripts first."""
    env = job_env(**extra)
    env.pop("PYTHONPATH", None)
    env["PATH"] = str(bin_dir) + os.pathsep + env["PATH"]
    return env


@pytest.fixture(scope="module")
def wheel_run(installed, data_dir, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`swbert-pretrain --config tiny_cpu --train-steps 3` from a folder outside the repository, on
    the defaults (embedded MLflow store, system metrics); the working folder and the result."""
    here = tmp_path_factory.mktemp("elsewhere")
    assert not (here / "ds_configs").exists()  # the recipe's ds_configs/zero2.json is the wheel's copy
    run = subprocess.run(
        [installed / "swbert-pretrain", "--config", "tiny_cpu", "--train-steps", "3", "--data-dir", data_dir,
         "--output-dir", "run", "--log-interval", "1"],
        cwd=here,
        env=outside_env(installed, MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1"),  # MLflow's default: 10 s
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )  # fmt: skip
    return here, run


@pytest.mark.slow
def test_wheel_pretrains_from_any_folder(installed, wheel_run, tmp_path):
    env = outside_env(installed)
    where = subprocess.run(
        [
            installed / "python",
            "-c",
            "import swbert, data_prep; print(swbert.__file__); print(data_prep.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert all(line.startswith(str(installed.parent)) for line in where.stdout.split()), where.stdout

    scripts = [
        "pretrain",
        "train-tokenizer",
        "preprocess",
        "verify",
        "finetune-glue",
        "finetune-squad",
        "report",
    ]
    for name in [*scripts, "scaling-study"]:
        assert (installed / f"swbert-{name}").is_file(), f"console script swbert-{name} is not installed"
    shown = subprocess.run(
        [installed / "swbert-preprocess", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0 and "--tokenizer" in shown.stdout, shown.stderr[-2000:]

    here, run = wheel_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    export = here / "run" / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert "auto_map" in json.loads((export / "config.json").read_text())  # the model's code went along
    assert (export / "modeling.py").is_file() and "trust_remote_code=True" in (
        export / "README.md"
    ).read_text()
    assert "model (Hugging Face folder): run/export" in run.stdout
    assert not (here / "mlruns").exists()  # MLflow's artifacts stay in the run folder


@pytest.mark.slow
def test_the_default_store_holds_a_loadable_model_system_metrics_and_the_configs(wheel_run):
    import mlflow
    from mlflow import MlflowClient

    here, run = wheel_run
    assert run.returncode == 0, run.stderr[-3000:]
    out = here / "run"
    uri = f"sqlite:///{out.parent / 'mlflow.db'}"
    assert f"MLflow store:                {uri}" in run.stdout
    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED"
    assert info.info.artifact_uri.startswith((out.parent / "mlartifacts").as_uri())

    system = {k for k in info.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system
    params = info.data.params
    assert params["size"] == "tiny" and params["deepspeed.zero_optimization.stage"] == "2"
    assert params["deepspeed.train_batch_size"] == "8"  # filled from the training config
    assert {"resolved_config.yaml", "ds_config.json", "model"} <= {
        a.path for a in client.list_artifacts(run_id)
    }
    assert json.loads((out / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"] == 4

    # set_tracking_uri also sets MLFLOW_TRACKING_URI in os.environ: restore both, or every later test
    # in this process that reads the variable would log into this store
    before, before_env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    finally:
        mlflow.set_tracking_uri(before)
        if before_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before_env
    predictions = model.predict(["the cat [MASK] the dog .", "a [MASK] ."], params={"top_k": 2})
    assert len(predictions) == 2 and all(len(p) == 2 for p in predictions)
    assert all(isinstance(p["token_str"], str) and 0 < p["score"] <= 1 for p in predictions[0])


def test_pretrain_help_describes_every_key():
    import dataclasses

    from swbert.training.cli import _help
    from swbert.training.config import TrainConfig, field_descriptions

    described = field_descriptions()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if not described.get(f.name)]
    assert not missing, f"give these TrainConfig fields a comment on their line in config.py: {missing}"
    text = _help()
    schedules = "['linear', 'cosine', 'constant', 'wsd', 'one_minus_sqrt']"
    assert "--lr-schedule" in text and f"one of {schedules}, default: 'linear'" in text
    assert described["warmup_steps"] in text


def test_deepspeed_config_names_resolve_but_a_given_path_wins(tmp_path, monkeypatch):
    from swbert.runtime.ds_config import find_ds_config

    monkeypatch.chdir(tmp_path)  # no ds_configs/ in the working directory
    assert find_ds_config("ds_configs/zero1.json").parent.name == "ds_configs"
    assert find_ds_config("zero3.json").name == "zero3.json"
    own = tmp_path / "ds_configs" / "zero1.json"
    own.parent.mkdir()
    own.write_text("{}")
    assert find_ds_config("ds_configs/zero1.json") == Path("ds_configs/zero1.json")  # the user's copy
    with pytest.raises(FileNotFoundError, match=r"elsewhere/zero2.json not found.*zero2.json"):
        find_ds_config("elsewhere/zero2.json")  # a path that is not there is never swapped for a shipped one
