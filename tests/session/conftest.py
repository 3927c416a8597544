"""Session tests: one torch thread (bit-exact CPU results, no thread oversubscription on CI)."""

from __future__ import annotations

import pytest
import torch
from session_testlib import plain_run


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A plain 3-epoch ``train()`` of ``tiny_config`` with checkpoints; read it, never write into it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return plain_run(str(tmp_path_factory.mktemp("reference") / "model"))
    finally:
        torch.set_num_threads(n)
