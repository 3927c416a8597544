"""The training loop, the one every driver steps through: a unit per train step and per epoch end.

    run_begin(goal)                 a driver starts (a Session train_* call, Engine.train)
    train_begin                     the loop's first unit (again after train_end once epochs are added)
    per unit: one train step → StepDone, or the epoch end (eval, scores, checkpoint) → EpochDone
    train_end                       right after the final epoch's end
    run_end(outcome, error)         the driver stops: "done", "paused" or "failed"

The Session pulls units one at a time (all at once, in time slices with an ``await`` between
them, or in a thread) and stops between two of them when paused; the CLI and torchrun run
them to the end through :meth:`Engine.train`. The loop keeps no position of its own: where
training stands is the engine's :class:`~kit.engine.progress.Progress`, so a restore, a
resume or a new ``num_epochs`` is simply where the next unit starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kit.engine.step import StepResult
from kit.events import RunBegin, RunEnd, TrainBegin, TrainEnd

if TYPE_CHECKING:
    from kit.engine.engine import Engine


@dataclass(frozen=True)
class StepDone:
    """A train step ran."""

    result: StepResult


@dataclass(frozen=True)
class EpochDone:
    """An epoch ended: its score row (``learning_rate``, ``train_loss_*``, ``dev_loss_*``, ...)."""

    epoch: int
    scores: dict[str, Any]


Unit = StepDone | EpochDone


class TrainingLoop:
    """Pull one unit at a time with :meth:`next_unit`; iterate to run to the end."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.running = False  # between train_begin and train_end

    def next_unit(self) -> Unit | None:
        """Run the next unit; None (after ``train_end``) once every epoch is trained."""
        engine = self.engine
        if not engine.progress.epoch_running and engine.all_trained:  # (within an epoch: a step or its end)
            self._end()
            return None
        if not self.running:
            self.running = True
            engine.events.emit(TrainBegin())
        result = engine.train_step()
        if result is not None:
            return StepDone(result)
        epoch = engine.progress.epoch
        unit = EpochDone(epoch, engine.finish_epoch())
        if engine.all_trained:
            self._end()
        return unit

    def __iter__(self) -> Iterator[Unit]:
        while (unit := self.next_unit()) is not None:
            yield unit

    def _end(self) -> None:
        if self.running:
            self.running = False
            self.engine.events.emit(TrainEnd())

    @contextlib.contextmanager
    def driven(self, goal: str) -> Iterator[RunOutcome]:
        """One driver's run: ``run_begin`` now, ``run_end`` when the block is left (``failed`` when it raises)."""
        outcome = RunOutcome()
        self.engine.events.emit(RunBegin(goal))
        try:
            yield outcome
        except BaseException as exc:
            self.engine.events.emit(RunEnd("failed", exc))
            raise
        self.engine.events.emit(RunEnd(outcome.value, None))


class RunOutcome:
    """How a run ended, set by its driver: ``"done"`` (the goal was reached) or ``"paused"``."""

    def __init__(self) -> None:
        self.value = "done"
