"""Unit tests of the DeepSpeed config builder's rules (swbert.runtime.ds_config): which fields it
fills, which values it refuses and how each error names the flag that sets the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swbert.runtime.ds_config import (
    BatchShape,
    Flags,
    build_ds_config,
    find_ds_config,
    load_ds_config,
    offloads_optimizer,
    resolve_precision,
    zero_stage,
)

BATCH = BatchShape(global_batch=32, micro_batch=4, accum=4)


def _template(tmp_path: Path, ds: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return path


def test_auto_fields_are_filled_from_the_run(tmp_path):
    ds = build_ds_config(_template(tmp_path, {"train_batch_size": "auto"}), BATCH, 1.0, "fp32")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (32, 4)
    assert (ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (4, 1.0)
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}


@pytest.mark.parametrize(
    "key, value, flag",
    [
        ("train_batch_size", 64, "--global-batch-size"),
        ("train_micro_batch_size_per_gpu", 8, "--micro-batch-size"),
        ("gradient_accumulation_steps", 2, "--grad-accum-steps"),
        ("gradient_clipping", 0.5, "--grad-clip"),
    ],
)
def test_a_hard_coded_value_that_disagrees_names_the_flag(tmp_path, key, value, flag):
    with pytest.raises(ValueError, match=f"sets {key}={value!r}.*choose the value with {flag}"):
        build_ds_config(_template(tmp_path, {key: value}), BATCH, 1.0, "fp32")


def test_a_hard_coded_value_that_agrees_is_kept(tmp_path):
    ds = build_ds_config(_template(tmp_path, {"train_batch_size": 32}), BATCH, 1.0, "fp32")
    assert ds["train_batch_size"] == 32


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_sections_are_refused(tmp_path, section):
    path = _template(tmp_path, {section: {"type": "Adam"}})
    with pytest.raises(ValueError, match=f"'{section}' section.*remove"):
        build_ds_config(path, BATCH, 1.0, "fp32")


def test_a_stage_above_the_jobs_maximum_is_refused_naming_the_job(tmp_path):
    path = _template(tmp_path, {"zero_optimization": {"stage": 3}})
    flags = Flags(job="fine-tuning")
    with pytest.raises(ValueError, match="ZeRO stage 3 is not supported for fine-tuning; use stage 0-2"):
        build_ds_config(path, BATCH, 1.0, "fp32", flags, max_zero_stage=2)
    assert zero_stage(build_ds_config(path, BATCH, 1.0, "fp32")) == 3  # pretraining allows it


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_explicit_precision_section_must_match_the_run(tmp_path, precision):
    path = _template(tmp_path, {"bf16": {"enabled": True}})
    if precision == "bf16":
        assert build_ds_config(path, BATCH, 1.0, precision)["bf16"]["enabled"] is True
    else:
        with pytest.raises(ValueError, match="bf16.enabled=True but the run's precision is fp32"):
            build_ds_config(path, BATCH, 1.0, precision)


def test_the_template_file_is_not_changed(tmp_path):
    path = _template(tmp_path, {"train_batch_size": "auto"})
    before = path.read_text()
    build_ds_config(path, BATCH, 1.0, "bf16")
    assert path.read_text() == before


def test_shipped_configs_are_found_by_name_and_a_missing_one_lists_them(tmp_path):
    assert find_ds_config("zero2.json").name == "zero2.json"
    assert find_ds_config("ds_configs/zero2.json").name == "zero2.json"
    with pytest.raises(FileNotFoundError, match=r"nope\.json not found.*zero2\.json"):
        find_ds_config("nope.json")
    with pytest.raises(FileNotFoundError):
        find_ds_config(tmp_path / "elsewhere" / "zero2.json")  # a path, not a bare name


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: invalid JSON"):
        load_ds_config(path)


def test_precision_auto_and_fp16_on_cpu():
    assert resolve_precision("auto", on_gpu=True) == "bf16"
    assert resolve_precision("auto", on_gpu=False) == "fp32"
    assert resolve_precision("bf16", on_gpu=False) == "bf16"
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        resolve_precision("fp16", on_gpu=False)


def test_optimizer_offload_is_read_from_zero_settings():
    assert not offloads_optimizer({})
    assert not offloads_optimizer({"zero_optimization": {"offload_optimizer": {"device": "none"}}})
    assert offloads_optimizer({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
