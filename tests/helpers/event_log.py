"""Every event of an ``Events``, recorded as ``(name, epoch, step)``-like tuples (the loop tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kit.events import EVENTS, Events


def key(name: str, payload: dict[str, Any]) -> tuple:
    """What the sequence compares: the name, and where in the loop (epoch, step) or how a run ended."""
    if name in ("epoch_begin", "epoch_end"):
        return (name, payload["epoch"])
    if name == "step_begin":
        return (name, payload["epoch"], payload["step"])
    if name == "step_end":
        return (name, payload["result"].epoch, payload["result"].step)
    if name == "run_end":
        return (name, payload["outcome"])
    return (name,)


def record(events: Events, into: list[tuple]) -> list[tuple]:
    for name in EVENTS:
        events.on(name, lambda _name=name, **payload: into.append(key(_name, payload)))
    return into


def install(into: list[tuple]) -> Callable[[], None]:
    """Record the events of every ``Events`` made from now on (the CLI makes its own engine); returns the undo."""
    real = Events.__init__

    def init(self: Events) -> None:
        real(self)
        record(self, into)

    def undo() -> None:
        Events.__init__ = real  # type: ignore[method-assign]

    Events.__init__ = init  # type: ignore[method-assign]
    return undo


@contextlib.contextmanager
def every_engine_recorded(into: list[tuple]) -> Iterator[list[tuple]]:
    """:func:`install` for the duration of the block."""
    undo = install(into)
    try:
        yield into
    finally:
        undo()



