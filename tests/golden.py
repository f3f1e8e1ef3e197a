"""Golden loss curves: every logged loss of a pretraining run, kept in the repository.

Equality between two code paths (TP=2 against TP=1, a resumed run against an uninterrupted one)
cannot see a change that shifts every path alike: a refactor that reorders an initialisation, a
different mask draw, a changed learning-rate formula. So the tests that run the tiny recipe also
compare each logged loss with `tests/assets/losses/<name>.json`, bit for bit.

Only a commit that changes the numerics on purpose regenerates the files, and its message says
why:

    make golden        # SWBERT_UPDATE_GOLDEN=1 on the tests that write them

CPU kernels differ by instruction set (AVX2, AVX512, ...) and torch version, and so do the last
bits of a loss. The files record where they were made; on another kind of machine the comparison
allows a relative difference of 1e-4 (still far below what any change of the method moves) and
says so in the failure message.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent / "assets" / "losses"
UPDATE = "SWBERT_UPDATE_GOLDEN"
OTHER_MACHINE_RTOL = 1e-4


def machine() -> dict[str, str]:
    """What decides the last bits of a CPU loss: torch's version and the kernels' instruction set."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def check_golden(name: str, metrics: dict[int, dict], key: str = "loss") -> None:
    """Compare `metrics[step][key]` for every logged step with the golden file `name`.

    With SWBERT_UPDATE_GOLDEN=1 the file is written instead (and the test passes)."""
    losses = {str(step): metrics[step].get(key) for step in sorted(metrics)}
    path = ASSETS / f"{name}.json"
    if os.environ.get(UPDATE) == "1":
        ASSETS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"made_on": machine(), key: losses}, indent=1) + "\n")
        return
    assert path.is_file(), f"no golden file {path}: run `make golden` and commit it"
    golden = json.loads(path.read_text())
    expected = golden[key]
    assert list(losses) == list(expected), f"{name}: logged steps {list(losses)} vs golden {list(expected)}"
    exact = golden["made_on"] == machine()
    how = (
        "bit for bit"
        if exact
        else f"rtol {OTHER_MACHINE_RTOL}: made on {golden['made_on']}, here {machine()}"
    )
    for step, want in expected.items():
        got = losses[step]
        close = got is not None and want is not None and math.isclose(got, want, rel_tol=OTHER_MACHINE_RTOL)
        same = got == want or (not exact and close)
        assert same, (
            f"{name}: {key} at step {step} is {got!r}, golden {want!r} "
            f"({how}). "
            "If this commit changes the numerics on purpose, run `make golden` and say why in the commit message."
        )
