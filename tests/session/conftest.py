"""Session tests: a shared reference run (tests/conftest.py already sets one torch thread)."""

from __future__ import annotations

import pytest
from session_testlib import plain_run


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A plain 3-epoch ``train()`` of ``tiny_config`` with checkpoints; read it, never write into it."""
    return plain_run(str(tmp_path_factory.mktemp("reference") / "model"))
