"""benchmarks/gpu_wheels.py (`make gpu-wheels`) without an index: the plan against constraints-cpu.txt
and pyproject.toml, the tags it asks pip for, and the checks it makes of a folder of wheels, on small
wheels made here."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag
from packaging.utils import parse_wheel_filename

from benchmarks import gpu_wheels
from benchmarks.gpu_wheels import check, image_implies, read_wheel, target_tags


def make_wheel(
    folder: Path, name: str, version: str, requires=(), tag="py3-none-any", payload=b"", extra=None
):
    """A minimal wheel: its METADATA (with Requires-Dist lines), a module, `extra` files."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        if payload:
            archive.writestr(f"{name.replace('-', '_')}/blob.bin", payload, compress_type=zipfile.ZIP_STORED)
        for arcname, text in (extra or {}).items():
            archive.writestr(arcname, text)
    return path


# --- the plan ---------------------------------------------------------------------------------------


def test_the_three_come_from_the_constraints_file_not_from_the_script(tmp_path):
    constraints = tmp_path / "c.txt"
    constraints.write_text(
        "# a comment\ntorch==2.13.0\ndeepspeed==0.19.9  # why\nmegatron-core==0.16.2\nTransformers==5.24.0\n"
    )
    pins = gpu_wheels.read_constraints(constraints)
    wanted = gpu_wheels.plan(pins)
    assert (wanted["deepspeed"], wanted["megatron-core"], wanted["transformers"]) == (
        "0.19.9",
        "0.16.2",
        "5.24.0",
    )
    assert "torch" not in wanted  # the image's
    constraints.write_text("torch==2.13.0\ndeepspeed==0.19.9\n")
    with pytest.raises(ValueError, match="megatron-core, transformers"):
        gpu_wheels.plan(gpu_wheels.read_constraints(constraints))


def test_the_plan_agrees_with_constraints_cpu_and_pyproject():
    """One version of each: the three at CI's pins; an extra that CI also pins, at CI's pin; every
    planned package of swbert's training path within pyproject.toml's range; the rest of that path
    in the image."""
    pins = gpu_wheels.read_constraints()
    wanted = gpu_wheels.plan()
    for name in gpu_wheels.ROOTS:
        assert wanted[name] == pins[name], name
    for name, version in wanted.items():
        if name in pins:
            assert version == pins[name], f"{name}: {version} here, {pins[name]} in constraints-cpu.txt"
    needs = gpu_wheels.read_needs()  # raises when pyproject.toml no longer requires one of them
    for name, specifier in needs.items():
        if name in wanted:
            assert specifier.contains(wanted[name]), (
                f"{name}=={wanted[name]} is outside pyproject's {specifier}"
            )
        else:
            assert name in gpu_wheels.IMAGE, f"{name}: neither planned nor in the image"


def test_pip_is_asked_for_cp312_binaries_on_x86_64_manylinux_only():
    wanted = gpu_wheels.plan()
    args = gpu_wheels.download_args(wanted, Path("DEST"))
    assert args[:2] == ["download", "--no-deps"] and "--only-binary=:all:" in args
    value = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert (value["--python-version"], value["--implementation"], value["--abi"]) == ("3.12", "cp", "cp312")
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert "manylinux_2_28_x86_64" in platforms and "manylinux2014_x86_64" in platforms
    assert all(p.endswith("_x86_64") and p.startswith("manylinux") for p in platforms)
    assert not any(p.startswith(f"manylinux_2_{minor}_") for p in platforms for minor in range(29, 40))
    pins = [a for a in args if "==" in a]
    assert sorted(pins) == sorted(f"{n}=={v}" for n, v in wanted.items() if n != "deepspeed")


# The wheels `make gpu-wheels` fetched on the day it was written: each must fit the target.
FETCHED = [
    "deepspeed-0.19.8-py3-none-any.whl",
    "hf_xet-1.8.0-cp38-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "msgpack-1.2.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
    "ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl",
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
]


@pytest.mark.parametrize("filename", FETCHED)
def test_the_fetched_kinds_of_wheel_fit_cpython_312(filename):
    assert parse_wheel_filename(filename)[3] & target_tags("3.12")


@pytest.mark.parametrize(
    "tag",
    [
        "cp311-cp311-manylinux_2_17_x86_64",  # another Python
        "cp313-abi3-manylinux_2_17_x86_64",  # a newer stable ABI than 3.12 has
        "cp312-cp312-manylinux_2_34_x86_64",  # a newer glibc than torch 2.11's wheels need
        "cp312-cp312-manylinux_2_17_aarch64",
        "cp312-cp312-musllinux_1_2_x86_64",
        "cp312-cp312-win_amd64",
        "pp310-pypy310_pp73-manylinux_2_17_x86_64",
    ],
)
def test_tags_that_do_not_fit(tag):
    assert Tag(*tag.split("-")) not in target_tags("3.12")


# --- what the image is known to hold ------------------------------------------------------------------


@pytest.mark.parametrize(
    "image, required, implied",
    [
        (">=1.5.0,<2.0", ">=1.31.0,<3.0", False),  # huggingface-hub: the image may have 1.5
        (">=0.23.1,<0.24.0", "<0.24.0,>=0.23.1", True),  # tokenizers: 5.17 and 5.23 ask the same
        (">=4.10.0", ">=4.16.0", False),
        (">=4.10.0", ">=4.1.0", True),
        (">=2.11,<2.12", ">=2.6.0", True),
        (">=1.2.0,<2.0.0", "<2.0.0,>=1.6.0", False),
        (">=0.23.0,<1", "<1,>=0.23.0", True),
        (">=0.23.0,<1", "<0.99", False),
        (">=1.0", ">1.0", False),
        (">1.0", ">1.0", True),
        (">=2", "!=1.5", True),
        (">=2", "==2.0", False),  # only a range is known
        ("", "", True),
        ("", ">=3.0", False),  # only the name is known
    ],
)
def test_image_implies(image, required, implied):
    assert image_implies(image, SpecifierSet(required)) is implied


# --- checking a folder -------------------------------------------------------------------------------

IMAGE = {"base": (">=2", "in the image"), "old": (">=1,<2", "in the image")}


def folder(tmp_path, **overrides):
    """app (swbert's need) -> dep (not in the image) -> base (in it); old: in the image, too old for dep."""
    spec = {
        "app": ("1.0", ["dep>=2", "base>=1", "winonly; sys_platform == 'win32'", "docs; extra == 'docs'"]),
        "dep": ("2.0", ["base", "old>=2"]),
        "old": ("2.5", []),
    }
    spec.update(overrides)
    return [read_wheel(make_wheel(tmp_path, n, v, r)) for n, (v, r) in spec.items() if v is not None]


def run_check(wheels, wanted=None, needs=None):
    wanted = {"app": "1.0", "dep": "2.0", "old": "2.5"} if wanted is None else wanted
    needs = {"app": SpecifierSet(">=1"), "base": SpecifierSet(">=1")} if needs is None else needs
    return check(wheels, wanted, needs=needs, image=IMAGE)


def test_a_complete_folder_passes(tmp_path):
    assert run_check(folder(tmp_path)) == []


def test_a_requirement_met_neither_here_nor_by_the_image(tmp_path):
    problems = run_check(folder(tmp_path, old=(None, [])))
    assert "no wheel of old==2.5" in problems
    assert "dep requires old>=2: neither here nor in the image (the image's: >=1,<2)" in problems


def test_a_wheel_nothing_needs(tmp_path):
    wheels = folder(tmp_path, spare=("0.1", []))
    assert run_check(wheels, wanted={"app": "1.0", "dep": "2.0", "old": "2.5", "spare": "0.1"}) == [
        "spare-0.1-py3-none-any.whl: needed by no requirement the image leaves unmet"
    ]


def test_a_wheel_outside_the_plan_or_at_another_version(tmp_path):
    problems = run_check(folder(tmp_path, dep=("2.1", ["base", "old>=2"])))
    assert problems == ["dep-2.1-py3-none-any.whl: the plan says dep==2.0"]
    problems = run_check(folder(tmp_path / "b", stray=("1", [])))
    assert "stray-1-py3-none-any.whl: not in the plan" in problems


def test_a_wheel_here_too_old_for_what_requires_it(tmp_path):
    problems = run_check(folder(tmp_path, dep=("2.0", ["base", "old>=3"])))
    assert problems == ["dep requires old>=3; the wheel here is 2.5"]


def test_a_wheel_for_another_python(tmp_path):
    wheels = folder(tmp_path)
    wheels.append(
        read_wheel(make_wheel(tmp_path / "b", "old", "2.5", tag="cp311-cp311-manylinux_2_17_x86_64"))
    )
    wheels = [w for w in wheels if not (w.name == "old" and "py3" in w.path.name)]
    assert run_check(wheels) == [
        "old-2.5-cp311-cp311-manylinux_2_17_x86_64.whl: no tag that CPython 3.12 on x86_64 manylinux installs"
    ]


def test_swbert_needs_checked_against_pyproject_ranges_and_the_image(tmp_path):
    problems = run_check(folder(tmp_path), needs={"app": SpecifierSet(">=1.5"), "missing": SpecifierSet()})
    assert "swbert requires app>=1.5; the wheel here is 1.0" in problems
    assert "swbert's training path imports missing: neither here nor in the image" in problems


# --- the deepspeed build, the emptying and the limit --------------------------------------------------


def deepspeed_wheel(folder: Path, installed_ops: str = "{'fused_adam': False, 'cpu_adam': False}") -> Path:
    info = f"version='0.19.8'\ninstalled_ops={installed_ops}\naccelerator_name='cpu'\n"
    return make_wheel(folder, "deepspeed", "0.19.8", extra={"deepspeed/git_version_info_installed.py": info})


def test_prebuilt_deepspeed_ops_are_found(tmp_path):
    assert gpu_wheels.prebuilt_ops(deepspeed_wheel(tmp_path / "jit")) == []
    built = deepspeed_wheel(tmp_path / "aot", "{'fused_adam': True, 'cpu_adam': False}")
    assert gpu_wheels.prebuilt_ops(built) == ["fused_adam"]


def test_fetch_empties_the_folder_and_builds_deepspeed_without_ops(tmp_path, monkeypatch):
    dest = tmp_path / "whl"
    stale = make_wheel(dest, "deepspeed", "0.19.7")
    (dest / "notes.txt").write_text("kept: only wheels are removed")
    calls = []

    def fake_pip(args, env=None):
        calls.append((args[0], (env or {}).get("DS_BUILD_OPS")))
        if args[0] == "wheel":
            deepspeed_wheel(Path(args[args.index("--wheel-dir") + 1]))
        else:
            assert not stale.exists()  # emptied before anything was fetched
            make_wheel(dest, "einops", "0.8.2")

    monkeypatch.setattr(gpu_wheels, "pip", fake_pip)
    gpu_wheels.fetch(dest, {"deepspeed": "0.19.8", "einops": "0.8.2"}, "3.12")
    assert calls == [("wheel", "0"), ("download", None)]
    assert sorted(p.name for p in dest.iterdir()) == [
        "deepspeed-0.19.8-py3-none-any.whl",
        "einops-0.8.2-py3-none-any.whl",
        "notes.txt",
    ]


def test_fetch_refuses_a_deepspeed_wheel_with_built_ops(tmp_path, monkeypatch):
    def fake_pip(args, env=None):
        deepspeed_wheel(Path(args[args.index("--wheel-dir") + 1]), "{'fused_adam': True}")

    monkeypatch.setattr(gpu_wheels, "pip", fake_pip)
    with pytest.raises(SystemExit, match="holds built ops \\(fused_adam\\)"):
        gpu_wheels.fetch(tmp_path / "whl", {"deepspeed": "0.19.8"}, "3.12")


def test_over_the_limit_it_says_so_in_one_line_and_fails(tmp_path, monkeypatch, capsys):
    make_wheel(tmp_path, "big", "1.0", payload=b"\0" * (3 * 2**20 // 2))  # 1.5 MiB, stored
    monkeypatch.setattr(gpu_wheels, "check", lambda *args, **kwargs: [])
    assert gpu_wheels.main(["--check", "--dest", str(tmp_path), "--limit-mib", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1.50 MiB, over the 1 MiB limit" in err[0]
    assert gpu_wheels.main(["--check", "--dest", str(tmp_path), "--limit-mib", "2"]) == 0
    out = capsys.readouterr().out
    assert "big-1.0-py3-none-any.whl" in out and "1 wheel " in out


def test_report_lists_each_wheel_and_the_total(tmp_path):
    wheels = [read_wheel(make_wheel(tmp_path, n, "1", payload=b"x" * 2**20)) for n in ("b", "a")]
    table, total = gpu_wheels.report(wheels)
    lines = table.splitlines()
    assert [line.split()[0] for line in lines] == ["a-1-py3-none-any.whl", "b-1-py3-none-any.whl", "2"]
    assert total == sum(w.path.stat().st_size for w in wheels) and lines[-1].endswith(
        f"{total / 2**20:.2f} MiB"
    )


def test_the_folder_is_ignored_by_git():
    text = (gpu_wheels.REPO / ".gitignore").read_text().splitlines()
    assert "/.whl/" in text and gpu_wheels.DEST == gpu_wheels.REPO / ".whl"
