"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.launch_utils import make_data_dir


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A tokenizer and shards built once per session by the real data_prep CLIs (about 15 s).

    Training only reads it, so every module's jobs share it."""
    return make_data_dir(tmp_path_factory.mktemp("tiny-data"))
