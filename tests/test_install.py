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

from tests.launch_utils import REPO, job_env

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


def outside_env(bin_dir: Path) -> dict[str, str]:
    """The job environment minus the repository on PYTHONPATH, with the new environment's scripts first."""
    env = job_env()
    env.pop("PYTHONPATH", None)
    env["PATH"] = str(bin_dir) + os.pathsep + env["PATH"]
    return env


def test_wheel_pretrains_from_any_folder(installed, data_dir, tmp_path):
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

    # no ds_configs/ here: the recipe's ds_configs/zero2.json is the copy inside the wheel
    assert not (tmp_path / "ds_configs").exists()
    run = subprocess.run(
        [installed / "swbert-pretrain", "--config", "tiny_cpu", "--train-steps", "3", "--data-dir", data_dir,
         "--output-dir", "run", "--log-interval", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    export = tmp_path / "run" / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert "auto_map" in json.loads((export / "config.json").read_text())  # the model's code went along
    assert (export / "modeling.py").is_file() and "trust_remote_code=True" in (
        export / "README.md"
    ).read_text()
    assert "model (Hugging Face folder): run/export" in run.stdout


def test_pretrain_help_describes_every_key():
    import dataclasses

    from swbert.training.cli import _help
    from swbert.training.config import TrainConfig, field_descriptions

    described = field_descriptions()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if not described.get(f.name)]
    assert not missing, f"give these TrainConfig fields a comment on their line in config.py: {missing}"
    text = _help()
    assert "--lr-schedule" in text and "one of ['linear', 'cosine', 'constant'], default: 'linear'" in text
    assert described["warmup_steps"] in text


def test_deepspeed_config_names_resolve_but_a_given_path_wins(tmp_path, monkeypatch):
    from swbert.training.ds_config import find_ds_config

    monkeypatch.chdir(tmp_path)  # no ds_configs/ in the working directory
    assert find_ds_config("ds_configs/zero1.json").parent.name == "ds_configs"
    assert find_ds_config("zero3.json").name == "zero3.json"
    own = tmp_path / "ds_configs" / "zero1.json"
    own.parent.mkdir()
    own.write_text("{}")
    assert find_ds_config("ds_configs/zero1.json") == Path("ds_configs/zero1.json")  # the user's copy
    with pytest.raises(FileNotFoundError, match=r"elsewhere/zero2.json not found.*zero2.json"):
        find_ds_config("elsewhere/zero2.json")  # a path that is not there is never swapped for a shipped one
