"""Calling user functions with keyword arguments, and errors from user code made readable."""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kit.errors import ConfigError
from kit.signatures import keyword_names

if TYPE_CHECKING:
    from kit.data.batch import Batch


def check_accepts_kwargs(fn: Callable, key: str) -> None:
    """User callables get keyword arguments and must take ``**kwargs`` (new ones may be added)."""
    if keyword_names(fn) is not None:
        name, sig = getattr(fn, "__qualname__", repr(fn)), inspect.signature(fn)
        raise ConfigError(
            f"config key '{key}': {name}{sig} must accept **kwargs "
            f"(kit calls it with keyword arguments and may pass more in the future), "
            f"e.g. def {getattr(fn, '__name__', 'f')}(*, ..., **_kwargs)"
        )


_ACCEPTS_KWARGS: weakref.WeakSet = weakref.WeakSet()  # checked once: inspect.signature costs ~10 µs


def call_user(fn: Callable, key: str, **kwargs: Any) -> Any:
    try:
        checked = fn in _ACCEPTS_KWARGS
    except TypeError:  # not weak-referenceable: check every call
        checked = False
    if not checked:
        check_accepts_kwargs(fn, key)
        try:
            _ACCEPTS_KWARGS.add(fn)
        except TypeError:
            pass
    return fn(**kwargs)


_CALL_MACHINERY = frozenset({"_call_impl", "_wrapped_call_impl"})


def module_call_stack(tb: types.TracebackType | None, model: torch.nn.Module | None) -> list[str]:
    """``(Module.method) path.to.module`` lines for the frames of ``model``'s modules in ``tb``.

    Read from the traceback after the fact, so it costs nothing while training
    (RETURNN installs hooks on every module call for the same information).
    """
    if model is None:
        return []
    names = {id(m): name or "(root)" for name, m in model.named_modules()}
    lines = []
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        # torch's Module.__call__ machinery would repeat every module twice
        if owner is not None and id(owner) in names and frame.f_code.co_name not in _CALL_MACHINERY:
            lines.append(f"({type(owner).__name__}.{frame.f_code.co_name}) {names[id(owner)]}")
        tb = tb.tb_next
    return lines


def annotate_exception(exc: BaseException, *, stage: str, model: torch.nn.Module | None,
                       batch: Batch | None = None) -> BaseException:
    """Append the module call stack and a batch summary to ``exc``, keeping its type."""
    if hasattr(exc, "kit_details"):  # annotated already (eval inside a train step, say)
        return exc
    parts = [f"kit: error in user code during {stage}"]
    stack = module_call_stack(exc.__traceback__, model)
    if stack:
        parts.append("module call stack:\n" + "\n".join(f"  {line}" for line in stack))
    if batch is not None and hasattr(batch, "summary"):
        try:
            parts.append(batch.summary())
        except Exception:  # the summary must never hide the real error
            pass
    note = "\n".join(parts)
    if exc.args and isinstance(exc.args[0], str) and not isinstance(exc, KeyError):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
    elif hasattr(exc, "add_note"):
        exc.add_note(note)
    exc.kit_details = note  # type: ignore[attr-defined]
    return exc
