"""Notebook views of a Session: the live dashboard and the checkpoint browser widget.

``import kit.widgets`` imports neither ipywidgets nor matplotlib; the classes load on first use.
Static HTML summaries (no ipywidgets) live in :mod:`kit.widgets.summary`.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Dashboard": "kit.widgets.dashboard",
    "CheckpointWidget": "kit.widgets.checkpoints",
    "TerminalView": "kit.widgets.terminal",
    "Timeline": "kit.widgets.timeline",
    "RankStrip": "kit.widgets.ranks",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kit.widgets' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
