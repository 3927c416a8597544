"""Shared pytest setup: marks the process as a test run and offers common fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# `from helpers.models import ...` works from every test folder (tests/ has no __init__.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Tiny models run fastest on one thread, and CI has two cores shared with subprocess tests.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # and in subprocesses (CLI, kernels)

# Set at import time so that subprocesses started by tests (CLI, torchrun) inherit it.
os.environ["KIT_TEST"] = "1"
# kit's state directory (event logs of runs in RETURNN's layout) goes under the test run's temp folder,
# never into the user's home
if "KIT_STATE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["KIT_STATE_DIR"] = tempfile.mkdtemp(prefix="kit-test-state-")
    atexit.register(shutil.rmtree, os.environ["KIT_STATE_DIR"], ignore_errors=True)


@pytest.fixture
def tmp_model_prefix(tmp_path: Path) -> Path:
    """A fresh checkpoint prefix (the ``model`` config key): ``<tmp>/model``."""
    return tmp_path / "model"
