"""Shared pytest setup: marks the process as a test run and offers common fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set at import time so that subprocesses started by tests (CLI, torchrun) inherit it.
os.environ["KIT_TEST"] = "1"


@pytest.fixture
def tmp_model_prefix(tmp_path: Path) -> Path:
    """A fresh checkpoint prefix (the ``model`` config key): ``<tmp>/model``."""
    return tmp_path / "model"
