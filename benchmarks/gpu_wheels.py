"""The wheels a lent GPU machine lacks, fetched where a package index is reachable, for a machine
where none is: deepspeed, megatron-core and transformers at the versions CI runs
(constraints-cpu.txt), protobuf (data_prep reads SentencePiece's model proto with it), and those of
their requirements that the machine's image does not hold, each for CPython 3.12 on x86_64 Linux,
into a git-ignored folder.

    python benchmarks/gpu_wheels.py                  # `make gpu-wheels`: .whl/, then the list
    python benchmarks/gpu_wheels.py --check          # check the folder as it is; nothing fetched
    python benchmarks/gpu_wheels.py --dest DIR --python-version 3.11   # the same set for 3.11

On the GPU machine (Python 3.12, no index):

    pip install --no-index --no-deps --target DIR .whl/*.whl
    PYTHONPATH=DIR:$PYTHONPATH PATH=DIR/bin:$PATH ...   # DIR/bin: the ninja binary of JIT-built ops

What the image holds is all we know of it (`IMAGE`): Python 3.12, torch 2.11 (CUDA 13) and what torch
requires, transformers 5.17 and what it requires, numpy, scipy, safetensors, sentencepiece, tokenizers,
xxhash, pyyaml, tqdm, psutil, pytest; no deepspeed, megatron-core, mlflow or datasets. The set is
for preparing a small corpus and pretraining on it with `--mlflow false` (DeepSpeed ZeRO,
megatron-core's tensor-parallel layers; `TRAINING_PATH`): mlflow, datasets, pyarrow, scikit-learn
and matplotlib are imported only by tracking, Hub corpora, fine-tuning and reports, and are left out.

DeepSpeed publishes no wheel: it is built here from its sdist with DS_BUILD_OPS=0, a pure-Python
wheel (py3-none-any) whose C++/CUDA ops are JIT-built on first use, as in CI's own install. The rest
are downloaded as binaries (--only-binary) for cp312 and the manylinux platforms up to glibc 2.28
(torch 2.11's own wheels need 2.28, so the image has at least that).

The folder is emptied of wheels first. Then every wheel is checked: its tags fit the target, one
version of each planned package and nothing else, each of `TRAINING_PATH` is here (in
pyproject.toml's range) or in the image, every requirement (Requires-Dist, markers read for the
target) of every wheel is met by a wheel here or is known to be met by the image (`IMAGE`), and
every wheel here is needed by a requirement the image does not meet. Then one line per wheel
with its size, and the total: over --limit-mib (40: the ignored files that travel with the working
tree to a lent machine are capped at 64 MiB in all) it is refused.

Exit status: 0 when the folder is complete and within the limit; 1 when a fetch or a check failed
(one line says which); 2 for bad flags.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import Specifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints-cpu.txt"
PYPROJECT = REPO / "pyproject.toml"
DEST = REPO / ".whl"
LIMIT_MIB = 40.0
PYTHON_VERSION = "3.12"  # the image's interpreter
# glibc 2.28 down to 2.5: torch 2.11's own wheels are manylinux_2_28, so the image runs those
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)) + (
    "manylinux2014_x86_64",  # the legacy names of 2_17, 2_12 and 2_5
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)

# The three the GPU check exists for, at the versions CI runs: read from constraints-cpu.txt.
ROOTS = ("deepspeed", "megatron-core", "transformers")

# What swbert itself imports when it prepares a small corpus (data_prep: tokenizer, shards) and
# pretrains on it with `--mlflow false`, as distributions: each is a wheel here or in `IMAGE`, and
# the wheels here are what these need (pyproject.toml's ranges hold for those here). Read off a run
# with every imported module recorded; left out as never imported there: mlflow (tracking),
# datasets, pyarrow and fsspec (Hub corpora), scikit-learn and scipy (fine-tuning metrics),
# matplotlib (reports), flash-attn (optional), nvidia-ml-py (MLflow's GPU metrics).
TRAINING_PATH = (
    "torch", "deepspeed", "megatron-core", "transformers", "numpy", "sentencepiece",
    "protobuf",  # data_prep/hf_tokenizer.py: sentencepiece's sentencepiece_model_pb2
    "tokenizers", "safetensors", "xxhash", "pyyaml", "tqdm", "psutil",
)  # fmt: skip

# The rest of what TRAINING_PATH needs, with their requirements, that the image does not hold at
# a version they accept; one version each (the one `make setup` resolves for CI, where the image
# gives no reason to differ). `check` fails when a requirement is met neither here nor by `IMAGE`,
# and when one of these is no longer needed.
EXTRAS: dict[str, tuple[str, str]] = {
    # swbert's own (TRAINING_PATH)
    "protobuf": ("7.36.2", "data_prep reads SentencePiece's model proto; not in the image"),
    # deepspeed's requirements
    "einops": ("0.8.2", "deepspeed; not in the image"),
    "hjson": ("3.1.0", "deepspeed (reads its JSON configs); not in the image"),
    "msgpack": ("1.2.4", "deepspeed; not in the image (compiled: cp312)"),
    "ninja": ("1.13.2", "deepspeed: its ops are JIT-built with `ninja`; not in the image"),
    "py-cpuinfo": ("9.0.0", "deepspeed; not in the image"),
    "pydantic": (
        "2.14.4",
        "deepspeed's config classes (>=2); the image may have none (only new typers need it)",
    ),
    "pydantic-core": ("2.50.5", "pydantic, which pins it exactly (compiled: cp312)"),
    "annotated-types": ("0.8.0", "pydantic; not in the image"),
    "typing-inspection": ("0.4.5", "pydantic; not in the image"),
    "typing-extensions": ("4.16.0", "pydantic needs >=4.16; the image is known to hold >=4.10 (torch's)"),
    # megatron-core's
    "packaging": ("26.4", "megatron-core needs >=24.2; the image's is >=20.9 (hub 1.5's)"),
    # transformers 5.23's
    "huggingface-hub": ("2.4.0", "transformers 5.23 checks >=1.31 at import; the image's: >=1.5,<2"),
    # huggingface-hub 2.4's (the version CI resolves; it talks HTTP through httpx2, not httpx)
    "click": ("8.5.1", "huggingface-hub needs >=8.4.2; the image's (typer's) version is not known"),
    "hf-xet": ("1.8.0", "huggingface-hub needs >=1.6; the image's is >=1.2 (compiled: abi3)"),
    "httpx2": ("2.16.2", "huggingface-hub 2; not in the image"),
    "httpcore2": ("2.16.2", "httpx2, which pins it exactly"),
    "anyio": ("4.16.0", "httpx2 needs >=4.10; the image's (httpx's) version is not known"),
    "idna": ("3.20", "httpx2 needs >=3.18; the image's (httpx's) version is not known"),
    "h11": ("0.16.0", "httpcore2 needs >=0.16; the image's (httpcore's) version is not known"),
    "truststore": ("0.10.5", "httpx2 and httpcore2; not in the image"),
}

# What the image is known to hold, as the versions it may have (a range; "" when only the name is
# known), and why we know. torch's requirements are known from torch, the rest of transformers
# 5.17's and huggingface-hub 1.5's (the oldest transformers 5.17 accepts) from theirs.
IMAGE: dict[str, tuple[str, str]] = {
    "torch": (">=2.11,<2.12", "listed: torch 2.11, CUDA 13"),
    "transformers": (">=5.17,<5.18", "listed (shadowed by the wheel here)"),
    "numpy": (">=1.17", "listed; transformers 5.17 requires >=1.17"),
    "scipy": ("", "listed"),
    "safetensors": (">=0.8.0", "listed; transformers 5.17 requires >=0.8.0"),
    "sentencepiece": ("", "listed"),
    "tokenizers": (">=0.23.1,<0.24.0", "listed; transformers 5.17 requires >=0.23.1,<0.24.0"),
    "xxhash": ("", "listed"),
    "pyyaml": (">=5.1", "listed; transformers 5.17 requires >=5.1"),
    "tqdm": (">=4.60", "listed; transformers 5.17 requires >=4.60"),
    "psutil": ("", "listed"),
    "pytest": ("", "listed"),
    "filelock": (">=3.10.0", "torch's; huggingface-hub 1.5 requires >=3.10.0"),
    "typing-extensions": (">=4.10.0", "torch requires >=4.10.0"),
    "sympy": (">=1.13.3", "torch's"),
    "networkx": (">=2.5.1", "torch's"),
    "jinja2": ("", "torch's"),
    "fsspec": (">=2023.5.0", "torch's; huggingface-hub 1.5 requires >=2023.5.0"),
    "setuptools": ("", "torch's on Python 3.12"),
    "regex": (">=2025.10.22", "transformers 5.17 requires >=2025.10.22"),
    "typer": ("", "transformers 5.17's"),
    "packaging": (">=20.9", "transformers 5.17's; huggingface-hub 1.5 requires >=20.9"),
    "huggingface-hub": (">=1.5.0,<2.0", "transformers 5.17 requires >=1.5.0,<2.0"),
    "httpx": (">=0.23.0,<1", "huggingface-hub 1.5 requires >=0.23.0,<1"),
    "hf-xet": (">=1.2.0,<2.0.0", "huggingface-hub 1.5 requires >=1.2.0,<2.0.0"),
}


def read_constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{canonical name: version} of the `name==version` lines of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        exact = [s for s in req.specifier if s.operator == "=="]
        if len(exact) == 1 and "*" not in exact[0].version:
            pins[canonicalize_name(req.name)] = exact[0].version
    return pins


def read_needs(pyproject: Path = PYPROJECT) -> dict[str, SpecifierSet]:
    """{canonical name: pyproject.toml's range} of every distribution in TRAINING_PATH."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    declared = {}
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        req = Requirement(line)
        declared[canonicalize_name(req.name)] = req.specifier
    undeclared = [name for name in TRAINING_PATH if canonicalize_name(name) not in declared]
    if undeclared:
        raise ValueError(f"{pyproject.name} does not require {', '.join(undeclared)} (TRAINING_PATH)")
    return {canonicalize_name(name): declared[canonicalize_name(name)] for name in TRAINING_PATH}


def plan(constraints: dict[str, str] | None = None) -> dict[str, str]:
    """{canonical name: version} of every wheel the folder is to hold: ROOTS from the constraints
    file, then EXTRAS."""
    constraints = read_constraints() if constraints is None else constraints
    missing = [name for name in ROOTS if name not in constraints]
    if missing:
        raise ValueError(f"{CONSTRAINTS.name} pins no {', '.join(missing)} (name==version)")
    wanted = {name: constraints[name] for name in ROOTS}
    for name, (version, _) in EXTRAS.items():
        wanted[canonicalize_name(name)] = version
    return wanted


def target_tags(python_version: str = PYTHON_VERSION) -> set[Tag]:
    """Every wheel tag a CPython of `python_version` on x86_64 manylinux (glibc <= 2.28) installs."""
    major, minor = (int(part) for part in python_version.split("."))
    abi = f"cp{major}{minor}"
    tags = set(cpython_tags((major, minor), [abi], PLATFORMS))
    tags |= set(compatible_tags((major, minor), f"cp{major}{minor}", PLATFORMS))
    return tags


def marker_environment(python_version: str = PYTHON_VERSION) -> dict[str, str]:
    """The values of environment markers on the target (for Requires-Dist lines)."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def download_args(wanted: dict[str, str], dest: Path, python_version: str = PYTHON_VERSION) -> list[str]:
    """`pip download` of every planned wheel but deepspeed's, binaries for the target only."""
    abi = "cp" + python_version.replace(".", "")
    args = ["download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    args += ["--python-version", python_version, "--implementation", "cp", "--abi", abi]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args + [f"{name}=={version}" for name, version in sorted(wanted.items()) if name != "deepspeed"]


def deepspeed_wheel_args(version: str, dest: Path) -> list[str]:
    """`pip wheel` of DeepSpeed's sdist (it publishes no wheel), with DS_BUILD_OPS=0 in the environment."""
    return [
        "wheel", "--no-deps", "--no-cache-dir", "--no-binary", "deepspeed", "--wheel-dir", str(dest),
        f"deepspeed=={version}",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Checking a folder of wheels


@dataclass
class Wheel:
    path: Path
    name: str  # canonical
    version: Version
    tags: frozenset[Tag]
    requires: list[Requirement]


def read_wheel(path: Path) -> Wheel:
    name, version, _, tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as archive:
        metadata = next(
            n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
        )
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    requires = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return Wheel(path, canonicalize_name(name), version, frozenset(tags), requires)


def image_implies(image_spec: str, required: SpecifierSet) -> bool:
    """Whether every version in the range `image_spec` (what the image may hold) meets `required`.
    Conservative: a clause it cannot decide from the range's bounds counts as unmet."""
    if not required:
        return True
    low = high = None  # the range: versions >= low (or > low when low_open), < high (or <= high)
    low_open = high_closed = False
    for clause in SpecifierSet(image_spec):
        v = Version(clause.version.rstrip(".*"))
        if clause.operator in (">=", ">") and (low is None or v >= low):
            low, low_open = v, clause.operator == ">"
        elif clause.operator in ("<", "<=") and (high is None or v <= high):
            high, high_closed = v, clause.operator == "<="
    return all(_range_meets(low, low_open, high, high_closed, clause) for clause in required)


def _range_meets(low, low_open, high, high_closed, clause: Specifier) -> bool:
    op = clause.operator
    if "*" in clause.version or op in ("==", "===", "~="):
        return False
    v = Version(clause.version)
    if op == ">=":
        return low is not None and low >= v
    if op == ">":
        return low is not None and (low > v or (low == v and low_open))
    if op == "<":
        return high is not None and (high < v or (high == v and not high_closed))
    if op == "<=":
        return high is not None and high <= v
    if op == "!=":
        return (low is not None and low > v) or (high is not None and high <= v)
    return False


def check(
    wheels: list[Wheel],
    wanted: dict[str, str],
    needs: dict[str, SpecifierSet] | None = None,
    image: dict[str, tuple[str, str]] | None = None,
    python_version: str = PYTHON_VERSION,
) -> list[str]:
    """What is wrong with a folder of wheels, one line each; [] when nothing. `needs`: what swbert
    requires on the training path (`read_needs`); `image`: what the machine holds (`IMAGE`)."""
    needs = read_needs() if needs is None else needs
    image = IMAGE if image is None else image
    image = {canonicalize_name(name): spec for name, (spec, _) in image.items()}
    problems = []
    by_name: dict[str, Wheel] = {}
    tags = target_tags(python_version)
    for wheel in wheels:
        if wheel.name in by_name:
            problems.append(f"two wheels of {wheel.name}: {by_name[wheel.name].path.name}, {wheel.path.name}")
        by_name[wheel.name] = wheel
        if not wheel.tags & tags:
            problems.append(
                f"{wheel.path.name}: no tag that CPython {python_version} on x86_64 manylinux installs"
            )
        if wheel.name not in wanted:
            problems.append(f"{wheel.path.name}: not in the plan")
        elif wheel.version != Version(wanted[wheel.name]):
            problems.append(f"{wheel.path.name}: the plan says {wheel.name}=={wanted[wheel.name]}")
    problems += [f"no wheel of {name}=={version}" for name, version in wanted.items() if name not in by_name]

    environment = marker_environment(python_version)
    todo = []
    for name, specifier in needs.items():
        here = by_name.get(name)
        if here is not None:
            todo.append(name)
            if not specifier.contains(here.version, prereleases=True):
                problems.append(f"swbert requires {name}{specifier}; the wheel here is {here.version}")
        elif name not in image:  # the image's listed packages carry no versions: the name must do
            problems.append(f"swbert's training path imports {name}: neither here nor in the image")
    needed = set()
    while todo:
        wheel = by_name[todo.pop()]
        if wheel.name in needed:
            continue
        needed.add(wheel.name)
        for req in wheel.requires:
            if req.marker is not None and not Marker(str(req.marker)).evaluate(environment):
                continue
            name = canonicalize_name(req.name)
            here = by_name.get(name)
            if here is not None and not req.specifier.contains(here.version, prereleases=True):
                problems.append(
                    f"{wheel.name} requires {req.name}{req.specifier}; the wheel here is {here.version}"
                )
            in_image = name in image and image_implies(image[name], req.specifier)
            if not in_image:
                if here is None:
                    known = f" (the image's: {image[name] or 'any version'})" if name in image else ""
                    problems.append(
                        f"{wheel.name} requires {req.name}{req.specifier}: neither here nor in the image{known}"
                    )
                else:
                    todo.append(name)
    for name in sorted(set(by_name) - needed):
        problems.append(f"{by_name[name].path.name}: needed by no requirement the image leaves unmet")
    return problems


def report(wheels: list[Wheel]) -> tuple[str, int]:
    """One line per wheel with its size, then the total; and the total in bytes."""
    total = sum(w.path.stat().st_size for w in wheels)
    width = max((len(w.path.name) for w in wheels), default=0)
    lines = [
        f"{w.path.name:<{width}}  {w.path.stat().st_size / 2**20:6.2f} MiB"
        for w in sorted(wheels, key=lambda w: w.name)
    ]
    count = f"{len(wheels)} wheel{'s' * (len(wheels) != 1)}"
    lines.append(f"{count:<{width}}  {total / 2**20:6.2f} MiB")
    return "\n".join(lines), total


# ---------------------------------------------------------------------------------------------------
# Fetching


def pip(args: list[str], env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0:
        raise SystemExit(f"error: pip {args[0]} failed (exit status {result.returncode}); see above")


def fetch(dest: Path, wanted: dict[str, str], python_version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="ds-wheel-") as build:
        env = dict(os.environ, DS_BUILD_OPS="0")  # every op left to JIT: no compiler, no CUDA here
        pip(deepspeed_wheel_args(wanted["deepspeed"], Path(build)), env=env)
        built = list(Path(build).glob("deepspeed-*.whl"))
        if len(built) != 1 or not built[0].name.endswith("-py3-none-any.whl"):
            raise SystemExit(
                f"error: the deepspeed build made {[p.name for p in built]}, not one py3-none-any wheel"
            )
        prebuilt = prebuilt_ops(built[0])
        if prebuilt:
            raise SystemExit(
                f"error: the deepspeed wheel holds built ops ({', '.join(prebuilt)}); DS_BUILD_OPS=0 should leave them to JIT"
            )
        shutil.move(built[0], dest / built[0].name)
    pip(download_args(wanted, dest, python_version))


def prebuilt_ops(path: Path) -> list[str]:
    """The ops a DeepSpeed wheel says it holds built (installed_ops), or its compiled modules."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        text = archive.read("deepspeed/git_version_info_installed.py").decode()
    scope: dict = {}
    exec(text, scope)  # the file setup.py writes: plain assignments
    built = [op for op, on in scope.get("installed_ops", {}).items() if on]
    return built + [n for n in names if n.endswith(".so")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dest", type=Path, default=DEST, help="the folder of wheels (default: .whl/)")
    parser.add_argument(
        "--python-version", default=PYTHON_VERSION, help="the target's X.Y (default: %(default)s)"
    )
    parser.add_argument(
        "--limit-mib", type=float, default=LIMIT_MIB, help="refuse a larger total (default: %(default)s)"
    )
    parser.add_argument("--check", action="store_true", help="check the folder as it is; fetch nothing")
    args = parser.parse_args(argv)
    wanted = plan()
    if not args.check:
        fetch(args.dest, wanted, args.python_version)
    wheels = [read_wheel(p) for p in sorted(args.dest.glob("*.whl"))]
    problems = check(wheels, wanted, python_version=args.python_version)
    table, total = report(wheels)
    print(table)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return 1
    if total > args.limit_mib * 2**20:
        print(
            f"error: the wheels in {args.dest} come to {total / 2**20:.2f} MiB, over the {args.limit_mib:g} MiB limit",
            file=sys.stderr,
        )
        return 1
    print(
        f"ok: {len(wheels)} wheels for CPython {args.python_version} on x86_64 manylinux in {args.dest}, {total / 2**20:.2f} MiB of {args.limit_mib:g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
