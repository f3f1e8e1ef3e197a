"""The architecture as built: training never imports the offline tools, the trainer is short steps
each callable alone, and every entry point speaks one command-line convention."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import runpy
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from swbert import cli
from tests.launch_utils import REPO

TRAINING = REPO / "swbert" / "training"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.slow
def test_training_never_imports_data_prep():
    found = {p.name: m for p in TRAINING.glob("*.py") for m in _imports(p) if m.split(".")[0] == "data_prep"}
    assert not found, found
    # and at run time: building a trainer loads nothing of data_prep
    code = "import sys, swbert.training.trainer, swbert.training.build; print('data_prep' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_planning_a_split_loads_no_megatron():
    """swbert.parallel exports on first use (PEP 562): the scaling study's memory estimates import
    swbert.parallel.plan without megatron-core and DeepSpeed (seconds of start-up each)."""
    code = (
        "import sys, swbert.parallel.plan, swbert.scaling.memory; import swbert.parallel as p; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'deepspeed'}), callable(p.partition_dim))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True"


def test_no_function_is_over_60_lines():
    """In the library and the offline tools: a longer one does several things, which get names."""
    long = []
    for path in [*(REPO / "swbert").rglob("*.py"), *(REPO / "data_prep").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} is {length} lines")
    assert not long, "\n".join(long)


def test_tests_mirror_the_package():
    """A test file sits in the folder of the subpackage it tests, or in e2e/ or project/
    (docs/architecture.md, Tests)."""
    subpackages = {p.parent.name for p in (REPO / "swbert").glob("*/__init__.py")}
    folders = subpackages | {"e2e", "project"}
    misplaced = [
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if path.parent.parent != REPO / "tests" or path.parent.name not in folders
    ]
    assert not misplaced, f"test files outside {sorted(folders)}: {misplaced}"
    assert all((REPO / "tests" / name).is_dir() for name in folders - {"launchers"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path, modules: set[str]) -> set[str]:
    """Every module `path` imports, at any depth: `from a import b` is `a.b` when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or {node.module}
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import path that comes back to where it started, as the modules along it."""
    circles = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == path[0]:
                circles.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest module
                walk([*path, nxt])

    for start in sorted(graph):
        walk([start])
    return circles


def test_the_runtime_modules_import_one_another_without_a_circle():
    """One way, function-level imports included: a circle hides which module a piece belongs to,
    and breaks when one of them is imported first."""
    files = [p for p in (REPO / "swbert" / "runtime").glob("*.py") if p.stem != "__init__"]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): (_targets(p, modules) & modules) - {_module_name(p)} for p in files}
    assert "swbert.runtime.extensions" in graph["swbert.runtime.dist"]  # the check sees imports
    assert not _circles(graph), _circles(graph)


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]


def _layers() -> list[list[set[str]]]:
    """docs/architecture.md's `layers` block, lowest first: per layer, its groups of units (peers
    apart)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    rows = [line.split(None, 1) for line in block.strip().splitlines()]
    rows.sort(key=lambda row: int(row[0]))
    return [[set(group.split()) for group in units.split("|")] for _, units in rows]


def test_imports_run_down_the_layers_the_architecture_page_states():
    """Pretraining, fine-tuning and scaling share swbert.runtime and import neither each other nor
    anything above them; the offline tools and launchers sit on top."""
    layers = _layers()
    where = {
        unit: (n, g) for n, groups in enumerate(layers) for g, units in enumerate(groups) for unit in units
    }

    def unit_of(module: str) -> str | None:
        matches = [u for u in where if module == u or (module.startswith(u + ".") and u != "swbert")]
        return max(matches, key=len, default=None)

    files = [p for d in ("swbert", "data_prep", "launchers") for p in (REPO / d).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    wrong = []
    for path in files:
        source = unit_of(_module_name(path))
        assert source is not None, f"{path.relative_to(REPO)} is in no layer of docs/architecture.md"
        for target in map(unit_of, _targets(path, modules)):
            if target is None or target == source:
                continue
            (n, g), (m, h) = where[source], where[target]
            if m > n or (m == n and g != h):
                wrong.append(f"{path.relative_to(REPO)} ({source}, layer {n}) imports {target} (layer {m})")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.slow
def test_build_steps_run_alone_before_any_process_group(data_dir, tmp_path, monkeypatch):
    """The steps before the process group, called one by one as a reader (or a test) would."""
    from swbert.training import build
    from swbert.training.config import build_config

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so the values the launcher mapping sets are undone
        monkeypatch.delenv(key)
    out = tmp_path / "run"
    cfg = build_config(
        "tiny_cpu", ["--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false"]
    )
    folder = build.open_run_folder(cfg)
    try:
        assert folder.lock is not None and (out / ".swbert.lock").is_file()
        assert folder.run_name == "tiny-shared" and folder.ckpt_root == out / "checkpoints"
        plan = build.plan_run(cfg)
        assert (plan.dims.world, plan.dims.dp_size, plan.precision) == (1, 1, "fp32")
        assert (plan.batch.global_batch, plan.batch.micro_batch, plan.batch.accum) == (8, 4, 2)
        assert plan.ds_config["gradient_accumulation_steps"] == 2 and plan.zero_stage == 2
        data = build.build_data(cfg)
        model_config = build.build_model_config(cfg, data)
        assert model_config.vocab_size == data.vocab_size and model_config.attention_type == "shared"
        record = build.run_record(cfg, data, model_config, plan)
        assert record["run"]["global_batch_size"] == 8 and record["run"]["data_parallel"] == 1
        from swbert.training.resume import resolve_resume

        assert resolve_resume(cfg, folder.ckpt_root, record) is None
        assert build.total_steps(cfg) == 20
        assert build.total_steps(dataclasses.replace(cfg, train_tokens=8 * 64 * 3 + 1)) == 4
    finally:
        build.release(folder)
    assert folder.lock is None
    build.release(build.open_run_folder(cfg))  # released: a second job takes the folder
    with pytest.raises(ValueError, match="no --data-dir"):
        build.build_data(dataclasses.replace(cfg, data_dir=None))


def test_fault_injection_is_an_environment_hook_not_a_config_key(monkeypatch):
    from swbert.training.config import TrainConfig
    from swbert.training.faults import NONFINITE_STEPS, nonfinite_faults

    assert not [f.name for f in dataclasses.fields(TrainConfig) if "fault" in f.name]
    monkeypatch.setenv(NONFINITE_STEPS, "3, 7:inf@1")
    faults = nonfinite_faults()
    assert math.isnan(faults.value_at(3, 0)) and math.isnan(faults.value_at(3, 1))
    assert (
        faults.value_at(7, 1) == math.inf and faults.value_at(7, 0) is None and faults.value_at(4, 0) is None
    )
    monkeypatch.setenv(NONFINITE_STEPS, "seven")
    with pytest.raises(ValueError, match="'seven' is not STEP"):
        nonfinite_faults()


# ---- the one command-line convention ---------------------------------------------------------------


@dataclass
class _Base:
    names: list[str]  # required, several values
    out: Path = Path("runs/x")  # where things go
    kind: Literal["a", "b"] = "a"  # one of two
    rates: list[float] = field(default_factory=lambda: [1.0])
    verbose: bool = True  # talk
    limit: int | None = None


@dataclass
class _Child(_Base):
    # a new default, described anew
    rates: list[float] = field(default_factory=lambda: [0.1, 0.01], metadata={"aliases": ("rate",)})
    steps: int = 3
    """a string below the field describes it too"""


def test_cli_values_lists_flags_and_aliases(tmp_path):
    argv = ["--names", "x=1", "y", "--rate", "1e-3", "2e-4", "--no-verbose", "--limit", "none", "--kind=b"]
    got = cli.build_config(_Child, None, argv)
    assert got.names == ["x=1", "y"] and got.rates == [1e-3, 2e-4] and got.verbose is False
    assert got.limit is None and got.kind == "b" and got.out == Path("runs/x") and got.steps == 3
    assert cli.build_config(_Child, None, ["--names", "a,b", "--rates", "[1, 2]"]).rates == [1.0, 2.0]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("names: [p, q]\nsteps: 9\nout: elsewhere\n")
    got = cli.build_config(_Child, recipe, ["--steps", "4"])  # the command line wins over the recipe
    assert (got.names, got.steps, got.out) == (["p", "q"], 4, Path("elsewhere"))


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--names is required"),
        (
            ["--names", "a", "--stpes", "2"],
            "unknown config key 'stpes' in the command line; did you mean 'steps'",
        ),
        (["--names", "a", "--kind", "c"], "kind='c' is not one of a, b"),
        (["--names", "a", "--steps", "2", "3"], "--steps takes one value"),
        (["--names", "a", "--steps", "two"], "--steps 'two': expected int"),
        (["--names", "a", "--limit"], "--limit needs a value"),
        (["names", "a"], "unexpected argument 'names'"),
    ],
)
def test_cli_bad_input_names_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        cli.build_config(_Child, None, argv)


@dataclass
class _Tool:
    direction: Literal["there", "back"] = field(metadata={"positional": True})  # which way
    inputs: list[Path] = field(metadata={"positional": True})  # files to read
    tag: str | None = None
    overwrite: bool = False


def test_cli_positions_for_tools():
    """A tool's inputs by position (argparse's `tool there IN... --tag T`): a list position takes
    every value up to the next --key; beside positions, a key takes one value and a boolean key
    only a true/false word."""
    got = cli.build_config(_Tool, None, ["there", "a", "b", "--tag", "t", "--overwrite"])
    assert (got.direction, got.inputs, got.tag, got.overwrite) == ("there", [Path("a"), Path("b")], "t", True)
    got = cli.build_config(_Tool, None, ["--tag", "t", "back", "--overwrite", "x", "y"])
    assert (got.direction, got.inputs, got.tag, got.overwrite) == ("back", [Path("x"), Path("y")], "t", True)
    got = cli.build_config(_Tool, None, ["--overwrite", "false", "--inputs", "z", "--direction", "back"])
    assert (got.direction, got.inputs, got.overwrite) == ("back", [Path("z")], False)
    assert cli.build_config(_Tool, None, ["there", "a,b.txt"]).inputs == [Path("a"), Path("b.txt")]
    verbatim = dataclasses.make_dataclass(
        "_Files", [("files", list[str], field(metadata={"positional": True, "commas": False}))]
    )
    assert cli.build_config(verbatim, None, ["a,b.txt", "[c]"]).files == ["a,b.txt", "[c]"]
    with pytest.raises(ValueError, match="INPUTS is required"):
        cli.build_config(_Tool, None, ["there"])
    with pytest.raises(ValueError, match="direction='up' is not one of there, back"):
        cli.build_config(_Tool, None, ["up", "a"])
    with pytest.raises(ValueError, match="did you mean 'tag'"):
        cli.build_config(_Tool, None, ["there", "a", "--tga", "t"])
    text = cli.help_text(_Tool, "usage: tool DIRECTION INPUTS... [--tag T]")
    assert "  DIRECTION" in text and "(by position, or --direction)" in text and "files to read" in text


def test_cli_help_lists_every_field_with_its_comment_and_inherited_ones():
    text = cli.help_text(_Child, "usage: x")
    assert "--names                    list[str], required" in text
    assert "where things go" in text and "talk" in text  # the base class's comments
    assert "a new default, described anew" in text and "(or --rate)" in text
    assert "a string below the field describes it too" in text
    assert "default: 'runs/x'" in text


@pytest.mark.parametrize(
    "launcher, required",
    [
        ("finetune_glue", ["--checkpoint", "c", "--output-dir", "o"]),
        ("finetune_squad", ["--checkpoint", "c", "--output-dir", "o"]),
        ("scaling_study", []),
        ("report", ["--out", "o"]),
    ],
)
def test_every_launcher_speaks_the_convention(launcher, required, capsys):
    """--help documents every key; a typo is refused with the closest key and status 2."""
    main = runpy.run_path(str(REPO / "launchers" / f"{launcher}.py"), run_name="launcher")["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "Every key can be given as --key value" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main([*required, "--experimnet", "x"])
    assert exit_.value.code == 2 and "did you mean 'experiment'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "tool, typo, meant",
    [
        ("swbert.params", ["--sise", "tiny"], "size"),
        ("swbert.training.budget", ["shards", "--epoch", "2"], "epochs"),
        ("swbert.training.export", ["ckpt", "--outptu", "o"], "output"),
        ("swbert.convert", ["from-hf", "a", "b", "--outptu", "o"], "output"),
        ("swbert.parallel.convert", ["hf", "a", "b", "--tga", "t"], "tag"),
        ("swbert.scaling.memory_check", ["--zeor", "1"], "zero"),
        ("swbert.upgrade", ["run", "--dry-rnu"], "dry_run"),
        ("swbert.evaluate", ["model", "--data-dri", "d"], "data_dir"),
    ],
)
def test_every_tool_speaks_the_convention(tool, typo, meant, capsys):
    """The offline tools too: --help from the field comments, a typo refused with the closest key."""
    main = importlib.import_module(tool).main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "Every key can be given as --key value" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(typo)
    assert exit_.value.code == 2 and f"did you mean {meant!r}" in capsys.readouterr().err
