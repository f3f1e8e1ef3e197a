"""The repository's commit-msg hook: a subject of at most 72 characters, then a blank line."""

from __future__ import annotations

import subprocess

import pytest

from tests.launch_utils import REPO

HOOK = REPO / ".githooks" / "commit-msg"


def _check(tmp_path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["bash", str(HOOK), str(path)], capture_output=True, text=True)


@pytest.mark.parametrize(
    "message, ok",
    [
        ("x" * 72 + "\n\nWhy it changed.\n", True),
        ("Subject alone\n", True),
        ("# a comment git strips\nShort subject\n\nbody\n", True),
        ("x" * 73 + "\n\nWhy it changed.\n", False),
        ("Short subject\nbody without a blank line\n", False),
    ],
)
def test_the_hook_holds_the_subject_to_72_characters(tmp_path, message, ok):
    result = _check(tmp_path, message)
    assert (result.returncode == 0) is ok, result.stderr
    if not ok:
        assert result.stderr.startswith("commit-msg: "), result.stderr
