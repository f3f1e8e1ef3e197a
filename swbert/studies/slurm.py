"""A study as a SLURM job array: one array task per point, written as OUTPUT_DIR/submit.sh; the
study's `--collect` then reads back what the tasks left (a point no task finished is `missing`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

SWITCH_VALUES = ("true", "false", "yes", "no", "1", "0", "on", "off")
# --collect's reason for a point that no array task has finished: reported, never recorded
NOT_RUN = "not run yet: its array task has not finished (submit.sh runs it)"


def without_switches(argv: Sequence[str], names: tuple[str, ...]) -> list[str]:
    """`argv` less the boolean flags `names`, in any spelling: `--x`, `--x=VALUE`, `--x VALUE`."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in names:
            following = argv[i + 1].lower() if i + 1 < len(argv) else ""
            skip = following in SWITCH_VALUES
        elif not arg.startswith(tuple(f"{name}=" for name in names)):
            out.append(arg)
    return out


def switch_given(argv: Sequence[str], name: str) -> bool:
    """Whether a command line turns the switch `name` on (`--x`, `--x true`, `--x=yes`)."""
    off = ("false", "no", "0", "off")
    for i, arg in enumerate(argv):
        if arg == name:
            return i + 1 >= len(argv) or argv[i + 1].lower() not in off
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1].lower() not in off
    return False


def write_array(
    folder: Path,
    tasks: int,
    script: str,
    args: Sequence[str],
    note: str = "",
    nodes: int | None = None,
    gpus_per_node: int = 0,
    job_name: str | None = None,
) -> tuple[Path, str]:
    """folder/submit.sh, run from the repository root: `sbatch --array=0-(tasks-1) ... SCRIPT ARGS`
    (`gpus_per_node=0`: CPU nodes, no GPU request); returns it and the command."""
    head = ["sbatch", f"--array=0-{tasks - 1}"]
    head += [f"--nodes={nodes}"] if nodes is not None else []
    head += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    head += [f"--job-name={job_name}"] if job_name else []
    command = shlex.join([*head, script, *args])
    folder.mkdir(parents=True, exist_ok=True)
    submit = folder / "submit.sh"
    submit.write_text(f"#!/bin/bash\n# from the repository root{'; ' + note if note else ''}\n{command}\n")
    return submit, command
