"""kit: a Jupyter-first training kit for PyTorch with RETURNN's engine semantics.

``import kit`` stays fast: submodules (and pandas, matplotlib, ipywidgets) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from kit.config import Config
from kit.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DataError,
    KitError,
    NonFiniteLossError,
    ScoreFileError,
    SessionStateError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

# public name -> module that defines it; resolved lazily by __getattr__
_LAZY = {
    "Batch": "kit.data.batch",
    "Field": "kit.data.batch",
    "get_run_ctx": "kit.run_ctx",
    "RunCtx": "kit.run_ctx",
    "Loss": "kit.run_ctx",
    "ScoreTable": "kit.scores",
    "Engine": "kit.engine.engine",
    "StepResult": "kit.engine.engine",
    "ForwardResult": "kit.engine.forward",
    "Session": "kit.session",
    "Paused": "kit.session",
    "TrainResult": "kit.session",
    "Event": "kit.events",
    "DebugContext": "kit.debug",
    "attach": "kit.attached",
}
_SUBMODULES = {"data", "engine", "checkpoints", "scores", "run_ctx", "debug", "widgets", "events",
               "cli", "config", "rng", "fileio", "session", "examples", "compat",
               "multiproc", "eventlog", "attached"}

__all__ = [
    "CheckpointError", "Config", "ConfigError", "CorruptCheckpointError", "DataError", "KitError",
    "NonFiniteLossError", "ScoreFileError", "SessionStateError", "UnsafeCheckpointError", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"kit.{name}")
    raise AttributeError(f"module 'kit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
