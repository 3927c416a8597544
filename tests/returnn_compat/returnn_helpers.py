"""Helpers for the RETURNN compatibility tests: run kit or real RETURNN in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NO_RETURNN = Path(__file__).resolve().parent / "no_returnn"


def returnn_installed() -> bool:
    from kit.compat import returnn_installed as installed

    return installed()


needs_returnn = pytest.mark.skipif(not returnn_installed(), reason="RETURNN is not installed (pip install returnn)")


def run_python(args: list[str], *, hide_returnn: bool = False, env: dict | None = None, cwd: Path | None = None,
               timeout: int = 240) -> subprocess.CompletedProcess:
    """``python ARGS`` with this checkout's kit first on the path (and RETURNN hidden if asked)."""
    path = [str(ROOT)] + ([str(NO_RETURNN)] if hide_returnn else [])
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **(env or {}))
    proc = subprocess.run([sys.executable, *args], env=full_env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc
