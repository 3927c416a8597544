"""The built-in debug hooks: :func:`capture` (the default), :func:`raise_`, :func:`post_mortem`."""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

import torch

from kit.engine.debugging import DebugContext
from kit.errors import KitError

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (torch, sys.modules["kit"])
)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def is_user_file(filename: str) -> bool:
    """Whether a frame of ``filename`` is user code (not torch, kit or the standard library)."""
    if filename.startswith("<frozen") or filename.startswith(_LIBRARY_DIRS):
        return False
    return not (filename.startswith(_STDLIB) and "-packages" not in filename)


class DebugStop(KitError):
    """Raised by :func:`raise_` for an event that carries no exception of its own."""

    def __init__(self, ctx: DebugContext):
        super().__init__(f"stopped by kit.debug.raise_ at {ctx.event} (epoch {ctx.epoch}, step {ctx.step})")
        self.context = ctx


def capture(ctx: DebugContext) -> None:
    """Default hook: keep failures (and break points) as ``session.last_failure``."""
    if ctx.event != "before_train_loop":
        ctx.keep()


def raise_(ctx: DebugContext) -> None:
    """Re-raise the event's exception (or :class:`DebugStop` when it has none)."""
    capture(ctx)
    if ctx.exception is not None:
        raise ctx.exception
    if ctx.event != "before_train_loop":
        raise DebugStop(ctx)


def post_mortem(ctx: DebugContext) -> None:
    """Open the debugger in the failing user code's frames (IPython's in a notebook, else pdb).

    Events without a raised exception (``nonfinite``, ``step``) have no failing frame:
    the context is printed instead; ``session.replay()`` finds the op.
    """
    capture(ctx)
    if ctx.event == "before_train_loop":
        return
    print(ctx)
    tb = ctx.exception.__traceback__ if ctx.exception is not None else None
    if tb is None:
        if ctx.event == "nonfinite":
            print("no failing frame to debug: call session.replay() to find the op that made the NaN/Inf")
        return
    try:
        from IPython.core.debugger import Pdb
    except ImportError:  # plain Python
        from pdb import Pdb  # type: ignore[assignment]
    below = _frames_below_user_code(tb)
    if below:
        print(f"(the debugger starts where the error was raised; `up` {below} times leads to your code)")
    debugger = Pdb()
    debugger.reset()
    debugger.interaction(None, tb)


def _frames_below_user_code(tb: Any) -> int:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    for i, filename in enumerate(reversed(frames)):
        if is_user_file(filename):
            return i
    return 0
