"""Variants from outside swbert (swbert.models.plugins): a .py file named by --plugins trains on two
ranks and exports; an installed package's `swbert.attention` entry point is found by name; the
Hugging Face weight conversions follow the registry. Every variant here is unregistered after its
test, so other tests see the paper's four only."""

from __future__ import annotations

import os
import sys
import textwrap
from unittest import mock

import pytest
import torch

from swbert.models import SWBertConfig, SWBertForMaskedLM, plugins as plugin_loader
from swbert.models.attention import (
    SharedAttention,
    SymmetricAttention,
    attention_class,
    attention_types,
    register_attention,
    unregister_attention,
)
from tests.launch_utils import launch, read_metrics

PLUGIN = '''
"""A variant defined outside swbert: shared attention whose values get a second, learned gain."""
import torch
from torch import nn

from swbert.models.attention import SharedAttention, register_attention


@register_attention("{name}")
class DoubleGainAttention(SharedAttention):
    qkv_plan = {{**SharedAttention.qkv_plan, "extra_gain": "heads"}}

    def __init__(self, config):
        super().__init__(config)
        self.extra_gain = nn.Parameter(torch.ones(config.hidden_size))

    def qkv(self, x):
        q, k, v = super().qkv(x)
        return q, k, v * self.split_heads(self.extra_gain.expand_as(x))
'''


def tiny(attention_type: str) -> SWBertConfig:
    return SWBertConfig.from_size("tiny", vocab_size=64, attention_type=attention_type)


@pytest.fixture
def forget_plugins(monkeypatch):
    """Registrations and imported plugin modules made by the test are undone after it."""
    before, modules = set(attention_types()), set(sys.modules)
    monkeypatch.setattr(plugin_loader, "_installed_loaded", False)
    yield
    for name in set(attention_types()) - before:
        unregister_attention(name)
    for name in set(sys.modules) - modules:  # the plugins' modules only, never a library's
        if name.startswith(("swbert_plugin_", "swbert_test_")):
            del sys.modules[name]


@pytest.mark.slow
def test_a_plugin_file_trains_on_two_ranks_and_its_export_loads(data_dir, tmp_path, forget_plugins, capsys):
    name = "test_plugin_double_gain"
    plugin = tmp_path / "my_attention.py"
    plugin.write_text(PLUGIN.format(name=name))
    out = tmp_path / "run"
    args = [
        "--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false",
        "--train-steps", "2", "--log-interval", "1", "--save-interval", "2", "--plugins", str(plugin),
    ]  # fmt: skip
    # the variant is unknown without the plugin, and a typo'd plugin is named: refused at start-up
    # (status 2), checked in this process since no rank is started for it
    from swbert.launchers.pretrain import main

    with mock.patch.dict(os.environ), pytest.raises(SystemExit) as exit_:
        main([*args, "--attention-type", name, "--plugins", "my_attentoin"])
    assert exit_.value.code == 2
    assert "plugins: no module named 'my_attentoin' on the Python path" in capsys.readouterr().err
    job = launch(2, [*args, "--attention-type", name])
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted(read_metrics(out)) == [1, 2]
    assert f"attention_type: {name}" in (out / "resolved_config.yaml").read_text()

    plugin_loader.import_plugin(str(plugin))  # this process, too, needs the plugin to load the export
    model = SWBertForMaskedLM.from_pretrained(out / "export").eval()
    assert type(model.bert.encoder.layers[0].attn).__name__ == "DoubleGainAttention"
    assert not torch.equal(model.bert.encoder.layers[0].attn.extra_gain, torch.ones(model.config.hidden_size))


def test_an_installed_packages_entry_point_is_found_by_name(tmp_path, monkeypatch, caplog, forget_plugins):
    """A package that declares its module in the `swbert.attention` group needs no flag: the name
    is looked up there when the registry does not hold it. A broken package is reported by name
    and does not stop the others."""
    site = tmp_path / "site"
    for dist, module, source in [
        ("swbert_test_good", "swbert_test_good_attention", PLUGIN.format(name="test_ep_double_gain")),
        ("swbert_test_broken", "swbert_test_broken_attention", "raise RuntimeError('needs a GPU library')"),
    ]:
        info = site / f"{dist}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[swbert.attention]\nvariant = {module}\n")
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ValueError, match="'test_ep_missing' is not one of"):
        attention_class("test_ep_missing")  # a miss imports the installed plugins, once
    assert "test_ep_double_gain" in attention_types()
    assert "swbert_test_broken_attention (entry point of swbert_test_broken) failed to import" in caplog.text
    assert "RuntimeError: needs a GPU library" in caplog.text
    model = SWBertForMaskedLM(tiny("test_ep_double_gain"))
    ids = torch.randint(5, 64, (2, 8))
    assert model(input_ids=ids, labels=ids).loss.isfinite()


def test_the_weight_conversions_follow_the_registry(tmp_path, forget_plugins):
    """A variant registered after swbert is imported that packs other names than the built-in
    ones: its folder keeps the separate projections on disk and loads back to the same model."""
    from safetensors.torch import load_file

    @register_attention("test_qu_pack")
    class QUAttention(SymmetricAttention):
        packed = {"in_proj": ("q_proj", "u_proj")}

    torch.manual_seed(0)
    model = SWBertForMaskedLM(tiny("test_qu_pack")).eval()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "bert.encoder.layers.0.attn.u_proj.weight" in saved and not any(".in_proj." in k for k in saved)
    loaded = SWBertForMaskedLM.from_pretrained(tmp_path).eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_subclass_of_shared_that_changes_qkv_computes_with_its_change():
    """Every variant runs the one forward on `qkv`: a subclass's change is never skipped."""

    class Doubled(SharedAttention):
        def qkv(self, x):
            q, k, v = super().qkv(x)
            return q, k, 2 * v

    config = tiny("shared")
    config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    doubled = Doubled(config).eval()
    plain = SharedAttention(config).eval()
    plain.load_state_dict(doubled.state_dict())
    x = torch.randn(2, 5, config.hidden_size)
    bias = plain.out_proj.bias
    torch.testing.assert_close(doubled(x) - bias, 2 * (plain(x) - bias))


def test_plugin_errors_are_clear(tmp_path, forget_plugins):
    with pytest.raises(ValueError, match="plugins: nope.py is not a file"):
        plugin_loader.import_plugin("nope.py")
    with pytest.raises(ValueError, match="no module named 'swbert_no_such_plugin'"):
        plugin_loader.import_plugin("swbert_no_such_plugin")
    needs = tmp_path / "needs_a_dependency.py"
    needs.write_text("import swbert_no_such_dependency\n")
    with pytest.raises(ModuleNotFoundError, match="swbert_no_such_dependency"):
        plugin_loader.import_plugin(str(needs))  # the plugin's own import error, as it is
    plugin = tmp_path / "again.py"
    plugin.write_text(PLUGIN.format(name="test_plugin_again"))
    first = plugin_loader.import_plugin(str(plugin))
    assert (
        plugin_loader.import_plugin(str(plugin)) is first
    )  # imported once; a second import would re-register
    assert attention_class("test_plugin_again").__name__ == "DoubleGainAttention"


def test_a_scaling_grid_of_a_plugin_variant_passes_the_plugin_on(tmp_path, forget_plugins):
    """The study imports the plugin to size its points, and every SLURM array task gets --plugins."""
    import shlex

    from swbert.scaling.study import StudyConfig, emit_slurm

    name = "test_plugin_scaled"
    plugin = tmp_path / "scaled.py"
    plugin.write_text(PLUGIN.format(name=name))
    cfg = StudyConfig(
        output_dir=tmp_path / "study", sizes=["tiny"], attentions=["shared", name], layouts=["z1"],
        plugins=[str(plugin)],
    )  # fmt: skip
    cfg.check()
    sweep, command = emit_slurm(cfg, nodes=1, gpus_per_node=8)
    assert f"--attention-type {name}" in sweep.read_text()
    words = shlex.split(command)
    assert words[words.index("--plugins") + 1] == str(plugin)
