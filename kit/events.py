"""Events: the training loop's extension points — an enum, a typed payload per event, one bus.

Where each event fires is :data:`LOOP` (the loop as pseudocode, also what :func:`show_loop` prints).

``run_begin`` / ``run_end`` frame each driver call (one per ``train_step()`` call, one per
``python -m kit train``); everything between them is the loop's. ``train_begin`` fires
again only after a ``train_end`` (more epochs added with ``extend``).

Subscribers get the payload's fields as keyword arguments (``fn(result, **_)`` for ``step_end``) — those
they name, or all of them when they take ``**kwargs``, so a handler keeps working when an event's
payload gains a field.
A subscriber that raises is reported once on the ``kit`` logger and detached: a broken view
never breaks training. A subscriber registered with ``may_raise=True`` (the debugger, whose
hook may stop training on purpose) is called first and its exception goes through.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from kit.signatures import keyword_names

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.data.batch import Batch
    from kit.engine.accounting import StepLosses
    from kit.engine.progress import Progress
    from kit.engine.step import StepResult
    from kit.errors import NonFiniteLossError
    from kit.rng import RngState

logger = logging.getLogger("kit")

# Where each event fires, as the loop (:mod:`kit.engine.loop`) reads — the same for every driver (a
# Session's train_* calls, ``python -m kit train``, torchrun). A constant, not the docstring:
# ``describe`` works under ``python -OO``, which strips docstrings.
LOOP = """\
    run_begin(goal)                               a driver starts stepping the loop
    train_begin                                   the loop's first unit
    for epoch in epochs:
        epoch_begin(epoch, learning_rate)         LR set, RNG reseeded, data planned
        for batch in epoch:
            step_begin(epoch, step, batch)
            train_step(model=, extern_data=)      user code under the run context
            nonfinite(error, batch)               guard fired, *before* any update (deferred
                                                  mode: when the flag is read, after the rewind)
            step_end(result)                      StepResult, losses still on device
            checkpoint_saved(checkpoint)          every save_every_n_steps
        eval_begin(datasets)
        eval_end(scores)                          {dataset: {score: value}}
        checkpoint_saved(checkpoint)              per save_interval
        epoch_end(epoch, scores)                  the epoch's full score row
    train_end                                     right after the final epoch's end
    interrupt(status)                             Session paused at a step boundary
    run_end(outcome, error)                       the driver stops: "done", "paused" or "failed"
    exception(error, stage, batch)                any exception from user code
    restored(progress)                            the training state was put back (restore, rewind)
    forward_end(result)
"""


class Event(str, enum.Enum):
    """The loop's events; a ``str``, so ``"step_end"`` names ``Event.STEP_END`` too."""

    RUN_BEGIN = "run_begin"
    TRAIN_BEGIN = "train_begin"
    EPOCH_BEGIN = "epoch_begin"
    STEP_BEGIN = "step_begin"
    NONFINITE = "nonfinite"
    STEP_END = "step_end"
    EVAL_BEGIN = "eval_begin"
    EVAL_END = "eval_end"
    CHECKPOINT_SAVED = "checkpoint_saved"
    EPOCH_END = "epoch_end"
    TRAIN_END = "train_end"
    EXCEPTION = "exception"
    INTERRUPT = "interrupt"
    RUN_END = "run_end"
    RESTORED = "restored"
    FORWARD_END = "forward_end"


EVENTS: tuple[str, ...] = tuple(e.value for e in Event)


# ---- payloads --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """What one event carries; subclasses name their event."""

    event: ClassVar[Event]


@dataclass(frozen=True)
class RunBegin(Payload):
    event = Event.RUN_BEGIN
    goal: str  # "steps", "epoch" or "train"


@dataclass(frozen=True)
class TrainBegin(Payload):
    event = Event.TRAIN_BEGIN


@dataclass(frozen=True)
class EpochBegin(Payload):
    event = Event.EPOCH_BEGIN
    epoch: int
    learning_rate: float


@dataclass(frozen=True)
class StepBegin(Payload):
    event = Event.STEP_BEGIN
    epoch: int
    step: int
    batch: Batch


@dataclass(frozen=True)
class NonFinite(Payload):
    event = Event.NONFINITE
    error: NonFiniteLossError
    batch: Batch
    step_losses: StepLosses
    rng: RngState | None  # torch's RNG before the bad step's user code (for a replay)


@dataclass(frozen=True)
class StepEnd(Payload):
    event = Event.STEP_END
    result: StepResult


@dataclass(frozen=True)
class EvalBegin(Payload):
    event = Event.EVAL_BEGIN
    datasets: list[str]


@dataclass(frozen=True)
class EvalEnd(Payload):
    event = Event.EVAL_END
    scores: dict[str, dict[str, float]]


@dataclass(frozen=True)
class CheckpointSaved(Payload):
    event = Event.CHECKPOINT_SAVED
    checkpoint: Checkpoint


@dataclass(frozen=True)
class EpochEnd(Payload):
    event = Event.EPOCH_END
    epoch: int
    scores: dict[str, Any]


@dataclass(frozen=True)
class TrainEnd(Payload):
    event = Event.TRAIN_END


@dataclass(frozen=True)
class ExceptionRaised(Payload):
    event = Event.EXCEPTION
    error: BaseException
    stage: str  # "train", "eval of 'dev'", "forward"
    batch: Batch | None
    rng: RngState | None  # torch's RNG before the failing step's user code (for a replay)


@dataclass(frozen=True)
class Interrupt(Payload):
    event = Event.INTERRUPT
    status: Any  # the TrainResult of the paused call


@dataclass(frozen=True)
class RunEnd(Payload):
    event = Event.RUN_END
    outcome: str  # "done", "paused" or "failed"
    error: BaseException | None


@dataclass(frozen=True)
class Restored(Payload):
    event = Event.RESTORED
    progress: Progress  # where training stands now


@dataclass(frozen=True)
class ForwardEnd(Payload):
    event = Event.FORWARD_END
    result: Any


PAYLOADS: dict[Event, type[Payload]] = {
    cls.event: cls for cls in (RunBegin, TrainBegin, EpochBegin, StepBegin, NonFinite, StepEnd, EvalBegin, EvalEnd,
                                CheckpointSaved, EpochEnd, TrainEnd, ExceptionRaised, Interrupt, RunEnd, Restored,
                                ForwardEnd)
}
_FIELDS: dict[type[Payload], tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in PAYLOADS.values()}

Handler = Callable[..., Any]


# ---- the bus --------------------------------------------------------------------------------------


class Events:
    """The bus: event → subscribers; :meth:`emit` calls each with the payload's fields as keywords."""

    def __init__(self) -> None:
        self._handlers: dict[Event, list[Handler]] = {e: [] for e in Event}
        self._raising: dict[Event, list[Handler]] = {e: [] for e in Event}
        self._accepts: dict[Handler, frozenset[str] | None] = {}  # the names a handler takes (None: all)

    def on(self, event: Event | str, fn: Handler, *, may_raise: bool = False) -> Handler:
        """Subscribe ``fn(**payload)`` to ``event``; returns ``fn`` (usable as a decorator).

        ``may_raise``: ``fn``'s exceptions stop the emitter (the debugger's hook); it runs before
        the other subscribers."""
        ev = _event(event)
        if not callable(fn):
            raise TypeError(f"event handler for {ev.value!r} must be callable, got {fn!r}")
        self._accepts[fn] = keyword_names(fn)
        (self._raising if may_raise else self._handlers)[ev].append(fn)
        return fn

    def off(self, event: Event | str, fn: Handler) -> None:
        ev = _event(event)
        for table in (self._raising, self._handlers):
            if fn in table[ev]:
                table[ev].remove(fn)

    def has(self, event: Event | str) -> bool:
        ev = _event(event)
        return bool(self._handlers[ev] or self._raising[ev])

    def handlers(self, event: Event | str) -> list[Handler]:
        ev = _event(event)
        return [*self._raising[ev], *self._handlers[ev]]

    def emit(self, payload: Payload) -> None:
        """Call every subscriber of ``payload.event``: the raising ones first (their errors go through),
        then the others (one that raises is logged and detached)."""
        ev = payload.event
        raising, safe = self._raising[ev], self._handlers[ev]
        if not raising and not safe:
            return
        kwargs = {name: getattr(payload, name) for name in _FIELDS[type(payload)]}
        for fn in list(raising):
            fn(**self._for(fn, kwargs))
        for fn in list(safe):
            try:
                fn(**self._for(fn, kwargs))
            except Exception as exc:  # a view must never break training
                logger.warning("event handler %s for %r raised %s: %s; detached it",
                               _name(fn), ev.value, type(exc).__name__, exc)
                self.off(ev, fn)

    def _for(self, fn: Handler, kwargs: dict[str, Any]) -> dict[str, Any]:
        names = self._accepts.get(fn)
        return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}

    def describe(self) -> str:
        """The loop in pseudocode with what is attached to each event (works under ``python -OO``)."""
        lines = []
        for line in LOOP.splitlines():
            lines.append(line)
            name = line.strip().split("(")[0].split(" ")[0]
            if name in EVENTS:
                indent = line[: len(line) - len(line.lstrip())]
                lines += [f"{indent}  -> {_name(fn)}" for fn in self.handlers(name)]
        return "\n".join(lines)


def _event(event: Event | str) -> Event:
    try:
        return Event(event)
    except ValueError:
        raise ValueError(f"unknown event {event!r}; known events: {', '.join(EVENTS)}") from None


def _name(fn: Handler) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def show_loop(events: Events | None = None) -> str:
    """The training loop as pseudocode (with the subscribers of ``events``, when given)."""
    return (events or Events()).describe()
