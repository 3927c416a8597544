"""Repository-level pytest setup (loaded for every pytest run inside this checkout).

Applies ``notebooks/nbval_sanitize.cfg`` to nbval when that file exists and no
``--nbval-sanitize-with`` was given, so that `python -m pytest` stays the one test command.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Test runs (tests and nbval kernels alike) use one thread per process: the models are tiny and
# CI has two cores shared with subprocesses and kernels.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# nbval kernels (also when only notebooks/ is collected) show kit's views in text mode: no live
# progress line or widget in a checked cell's output (tests/conftest.py sets the same for tests/)
os.environ.setdefault("KIT_TEST", "1")

SANITIZE_FILE = Path(__file__).resolve().parent / "notebooks" / "nbval_sanitize.cfg"


def pytest_configure(config: pytest.Config) -> None:
    option = config.option
    if (
        hasattr(option, "nbval_sanitize_with")
        and option.nbval_sanitize_with is None
        and SANITIZE_FILE.is_file()
    ):
        option.nbval_sanitize_with = str(SANITIZE_FILE)
