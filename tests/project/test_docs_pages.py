"""Every page of docs/ names what checks it: `make docs-check` for its commands, and the tests or
benchmarks that hold what it states, each of which exists."""

from __future__ import annotations

import re

import pytest

from tests.launch_utils import REPO

PAGES = sorted((REPO / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_each_docs_page_names_the_checks_of_its_commands(page):
    lines = [line for line in page.read_text().splitlines() if line.startswith("Checked by: ")]
    assert len(lines) == 1, f"{page.name}: no 'Checked by: ' line (make docs-check, and its tests)"
    line = lines[0]
    assert "`make docs-check`" in line, line
    named = [t for t in re.findall(r"`([^`\s]+)`", line) if "/" in t]
    assert any(t.startswith("tests/") for t in named), f"{page.name}: names no test: {line}"
    missing = [t for t in named if not (REPO / t).exists()]
    assert not missing, f"{page.name} names files that do not exist: {missing}"
