"""Events: the training loop's extension points, and safe dispatch.

Where each event fires, as the loop (:mod:`kit.engine.loop`) reads — the same for every
driver (a Session's train_* calls, ``python -m kit train``, torchrun)::

    run_begin(goal)                               a driver starts stepping the loop
    train_begin                                   the loop's first unit
    for epoch in epochs:
        epoch_begin(epoch, learning_rate)         LR set, RNG reseeded, data planned
        for batch in epoch:
            step_begin(epoch, step, batch)
            train_step(model=, extern_data=)      user code under the run context
            nonfinite(error)                      guard fired, *before* any update (deferred
                                                  mode: when the flag is read, rewound to the bad step)
            step_end(result)                      StepResult, losses still on device
            checkpoint_saved(checkpoint)          every save_every_n_steps
        eval_begin(datasets)
        eval_end(scores)                          {dataset: {score: value}}
        checkpoint_saved(checkpoint)              per save_interval
        epoch_end(epoch, scores)                  the epoch's full score row
    train_end                                     right after the final epoch's end
    interrupt(status)                             Session paused at a step boundary
    run_end(outcome, error)                       the driver stops: "done", "paused" or "failed"
    exception(error, stage)                       any exception from user code
    forward_end(result)

``run_begin`` / ``run_end`` frame each driver call (one per ``train_step()`` call, one per
``python -m kit train``); everything between them is the loop's. ``train_begin`` fires
again only after a ``train_end`` (more epochs added with ``extend``).

A subscriber that raises is reported once on the ``kit`` logger and detached: a broken
view never breaks training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kit")

EVENTS: tuple[str, ...] = (
    "run_begin",
    "train_begin",
    "epoch_begin",
    "step_begin",
    "nonfinite",
    "step_end",
    "eval_begin",
    "eval_end",
    "checkpoint_saved",
    "epoch_end",
    "train_end",
    "exception",
    "interrupt",
    "run_end",
    "forward_end",
)

Handler = Callable[..., Any]


class Events:
    """Event name → list of callables; ``emit`` calls each with keyword arguments."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {name: [] for name in EVENTS}

    def on(self, event: str, fn: Handler) -> Handler:
        """Subscribe ``fn(**payload)`` to ``event``; returns ``fn`` (usable as a decorator)."""
        self._check(event)
        if not callable(fn):
            raise TypeError(f"event handler for {event!r} must be callable, got {fn!r}")
        self._handlers[event].append(fn)
        return fn

    def off(self, event: str, fn: Handler) -> None:
        self._check(event)
        if fn in self._handlers[event]:
            self._handlers[event].remove(fn)

    def has(self, event: str) -> bool:
        return bool(self._handlers[event])

    def handlers(self, event: str) -> list[Handler]:
        return list(self._handlers[event])

    def emit(self, event: str, **payload: Any) -> None:
        """Call every subscriber; one that raises is logged and detached."""
        for fn in list(self._handlers[event]):
            try:
                fn(**payload)
            except Exception as exc:  # a view must never break training
                logger.warning("event handler %s for %r raised %s: %s; detached it",
                               _name(fn), event, type(exc).__name__, exc)
                self.off(event, fn)

    def describe(self) -> str:
        """The loop in pseudocode with what is attached to each event."""
        lines = []
        doc = (__doc__ or "").split("::", 1)[1].split("\n\n")[1]
        for line in doc.splitlines():
            lines.append(line)
            name = line.strip().split("(")[0].split(" ")[0]
            if name in self._handlers:
                indent = line[: len(line) - len(line.lstrip())]
                lines += [f"{indent}  -> {_name(fn)}" for fn in self._handlers[name]]
        return "\n".join(lines)

    def _check(self, event: str) -> None:
        if event not in self._handlers:
            raise ValueError(f"unknown event {event!r}; known events: {', '.join(EVENTS)}")


def _name(fn: Handler) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__
