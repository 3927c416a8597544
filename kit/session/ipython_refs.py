"""Dropping what IPython keeps alive: the last traceback, stored errors and output cache.

``Session.close()`` uses this so that closing really frees the model in a notebook.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def _holds(exc: BaseException | None, refs: set[int]) -> bool:
    """Whether a frame of ``exc``'s traceback (or of its cause/context chain) holds one of ``refs``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _tb_holds(exc.__traceback__, refs):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _tb_holds(tb: Any, refs: set[int]) -> bool:
    while tb is not None:
        if any(id(v) in refs for v in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def drop_references_to(holders: Sequence[object], values: Sequence[object | None]) -> None:
    """Before a session closes: stored exceptions whose frames hold any of ``holders`` or ``values``
    (the session, its engine, model, optimizer), and cached outputs that are one of ``values``."""
    kept = [v for v in values if v is not None]
    drop_stored_references({id(o) for o in (*holders, *kept)}, {id(o) for o in kept})


def drop_stored_references(frame_refs: set[int], value_refs: set[int]) -> None:
    """Forget stored exceptions whose frames hold ``frame_refs``, and cached outputs in ``value_refs``."""
    last = getattr(sys, "last_value", None) or getattr(sys, "last_exc", None)
    if last is not None and _holds(last, frame_refs):
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    result = getattr(shell, "last_execution_result", None)
    if result is not None and _holds(getattr(result, "error_in_exec", None), frame_refs):
        result.error_in_exec = None
    formatter = getattr(shell, "InteractiveTB", None)  # keeps the traceback for %debug
    if formatter is not None and _tb_holds(getattr(formatter, "tb", None), frame_refs):
        formatter.tb = None
    ns = getattr(shell, "user_ns", {})
    out = ns.get("Out")
    if isinstance(out, dict):
        for key in [k for k, v in out.items() if id(v) in value_refs]:
            del out[key]
    for name in [k for k, v in ns.items() if _is_output_variable(k) and id(v) in value_refs]:
        ns[name] = None
    hook = getattr(shell, "displayhook", None)
    for name in ("_", "__", "___"):
        if hook is not None and id(getattr(hook, name, None)) in value_refs:
            setattr(hook, name, None)


def _is_output_variable(name: str) -> bool:
    """IPython's output cache names: ``_``, ``__``, ``___``, ``_12``."""
    return name in ("_", "__", "___") or (name.startswith("_") and name[1:].isdigit())
