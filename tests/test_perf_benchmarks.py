"""The benchmarks run end to end in their seconds-long smoke mode, so they cannot rot."""

import json

from benchmarks import train_step


def test_train_step_benchmark_smoke(tmp_path, capsys):
    out = train_step.main(["--smoke", "--inference", "--json", str(tmp_path / "result.json")])
    assert set(out["models"]) == set(train_step.MODELS)
    for name, row in out["models"].items():
        assert len(row["step_s"]) == len(row["cpu_s"]) == 2, name
        assert row["tokens_per_s"] > 0 and row["activation_bytes"] > 0, name
    # the reference computes its vocabulary-wide head on every token: more FLOPs and memory
    assert out["models"]["hf"]["flops_per_token"] > out["models"]["standard"]["flops_per_token"]
    assert out["models"]["shared"]["params"] < out["models"]["standard"]["params"]
    for key in (
        "shared/standard",
        "symmetric/standard",
        "pairwise/standard",
        "standard/hf",
        "shared fold speedup",
    ):
        assert out["ratios"][key] > 0, key
    assert json.loads((tmp_path / "result.json").read_text())["ratios"] == out["ratios"]
    printed = capsys.readouterr().out
    assert "shared/standard throughput" in printed and "outputs equal" in printed
