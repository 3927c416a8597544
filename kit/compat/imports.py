"""``import returnn.frontend`` in a config when RETURNN is not installed: kit's stand-in, for a while.

:func:`returnn_imports` installs a meta-path finder that resolves ``returnn`` and its submodules
to the small package in ``kit/compat/fallback`` — only when no real RETURNN is importable, and only
inside the ``with`` block (kit wraps loading a config and running its functions in it). On exit the
stand-in modules leave ``sys.modules`` again, so a RETURNN installed later is never shadowed; the
config keeps the module objects it bound (``rf``), which is all its functions need.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from kit.errors import KitError

logger = logging.getLogger("kit")

INSTALL_HINT = "pip install returnn dm-tree (or: pip install 'kit-train[returnn]')"


class ReturnnRequired(KitError, AttributeError):
    """A config uses a part of RETURNN that kit's stand-in does not provide, and RETURNN is not installed.

    An ``AttributeError`` too, so that ``hasattr`` and ``getattr(..., default)`` on the stand-in keep working.
    """

    def __init__(self, name: str):
        self.what = name
        super().__init__(
            f"{name} needs RETURNN itself, which is not installed (kit stands in only for RETURNN's run "
            f"context, tensor views and a few returnn.util.basic helpers): {INSTALL_HINT}"
        )


def missing_attribute(module: str, name: str) -> AttributeError:
    """The error a stand-in module's ``__getattr__`` raises for ``name``."""
    if name.startswith("__"):
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return ReturnnRequired(f"{module}.{name}")


def returnn_missing(exc: BaseException) -> ReturnnRequired | None:
    """``exc`` (or an exception in its chain) as a :class:`ReturnnRequired`, when it stems from RETURNN being absent."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, ReturnnRequired):
            return exc
        name = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and isinstance(name, str) and name.split(".")[0] == "returnn":
            return ReturnnRequired(f"module {name}")
        exc, seen = exc.__cause__ or exc.__context__, seen + 1  # type: ignore[assignment]
    return None

FALLBACK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fallback")
_lock = threading.RLock()
_depth = 0
_said_once = False


class _FallbackFinder:
    """Finds ``returnn`` / ``returnn.*`` in kit's fallback directory (and nothing else)."""

    def __init__(self) -> None:
        self.used = False

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name != "returnn" and not name.startswith("returnn."):
            return None
        search = [FALLBACK_DIR] if name == "returnn" else path
        spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is not None:
            self.used = True
        return spec


_finder = _FallbackFinder()


def returnn_installed() -> bool:
    """Whether a real RETURNN package is importable (kit's stand-in does not count)."""
    module = sys.modules.get("returnn")
    if module is not None:
        return not getattr(module, "KIT_FALLBACK", False)
    with _lock:
        hidden = _finder in sys.meta_path
        if hidden:
            sys.meta_path.remove(_finder)
        try:
            return importlib.util.find_spec("returnn") is not None
        except (ImportError, ValueError):
            return False
        finally:
            if hidden:
                sys.meta_path.insert(0, _finder)


def is_fallback_module(module: Any) -> bool:
    name = getattr(module, "__name__", "")
    file = getattr(module, "__file__", None) or ""
    return (name == "returnn" or name.startswith("returnn.")) and file.startswith(FALLBACK_DIR)


@contextlib.contextmanager
def returnn_imports() -> Iterator[bool]:
    """Inside the block, ``import returnn...`` resolves to kit's stand-in when RETURNN is absent.

    Yields whether the stand-in is active. Nested and concurrent uses share one installation.
    """
    global _depth
    if returnn_installed():
        yield False
        return
    with _lock:
        if _depth == 0:  # first: a finder that hides a broken or blocked RETURNN must not shadow it
            sys.meta_path.insert(0, _finder)
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                sys.meta_path.remove(_finder)
                for name in [n for n, m in sys.modules.items() if is_fallback_module(m)]:
                    del sys.modules[name]


def note_fallback_used(source: str) -> None:
    """Log once per process that a config's RETURNN imports were answered by kit's stand-in."""
    global _said_once
    if _finder.used and not _said_once:
        _said_once = True
        logger.info("RETURNN is not installed: the returnn imports of %s use kit's compatibility module "
                    "(kit.compat: returnn.frontend, returnn.tensor, returnn.util.basic)", source)
