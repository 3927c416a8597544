"""The built-in debug hooks: :func:`capture` (the default), :func:`raise_`, :func:`post_mortem`."""

from __future__ import annotations

import contextlib
from typing import Any

from kit.debug.context import DebugContext, is_user_file
from kit.errors import KitError


class DebugStop(KitError):
    """Raised by :func:`raise_` for an event that carries no exception of its own."""

    def __init__(self, ctx: DebugContext):
        super().__init__(f"stopped by kit.debug.raise_ at {ctx.event} (epoch {ctx.epoch}, step {ctx.step})")
        self.context = ctx


def capture(ctx: DebugContext) -> None:
    """Default hook: keep failures (and break points) as ``session.last_failure``."""
    if ctx.event != "before_train_loop" and ctx.owner is not None:
        with contextlib.suppress(ReferenceError):
            ctx.owner.last_failure = ctx


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
        from pdb import Pdb
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
