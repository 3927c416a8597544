"""The loop driver of a :class:`kit.Session`: sync, awaitable and background, one mechanism.

Every ``train_*`` call steps through the engine's loop (:mod:`kit.engine.loop`) unit by
unit towards its goal: all at once (``train_*``), in time slices with an ``await`` between
them (``train_*_async``, so widget messages such as the Pause button reach the kernel), or
in a thread (``train_in_background``). Interrupts, Pause and break points stop it between
two units, at a step boundary.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kit.engine.loop import RunOutcome, StepDone
from kit.errors import SessionStateError
from kit.session.interrupts import InterruptGuard
from kit.session.lifecycle import Status

if TYPE_CHECKING:
    from kit.session.facade import Session

logger = logging.getLogger("kit")


@dataclass
class Paused:
    """Returned by a ``train_*`` call that stopped at a step boundary (interrupt or Pause)."""

    epoch: int
    step: int
    reason: str
    paused: bool = True
    goal: str = "train"  # what the paused call was doing: "train", "epoch" or "steps"
    steps_left: int = 0  # with goal "steps": how many of its steps it had still to do
    mode: str = "blocking"  # how it ran: "blocking" (train_*), "awaitable" (train_*_async) or "background"

    def __str__(self) -> str:
        return (
            f"paused at epoch {self.epoch}, step {self.step} ({self.reason}) — "
            f"call train_epoch() or train() to continue"
        )

    __repr__ = __str__


_PAUSED = object()
Units = Generator[None, None, Any]


class LoopDriver:
    """Steps the engine's loop for one session; owns the interrupt guard and the background thread."""

    def __init__(self, session: Session):
        self.session = session
        self.guard = InterruptGuard()
        self.thread: threading.Thread | None = None
        self.background: dict[str, Any] = {}
        self.yield_every_secs = 0.05  # async variants yield to the kernel at most this often
        self.mode = "blocking"  # how the current call runs: "blocking", "awaitable" or "background"
        self.paused_goal: tuple[str, int] = ("train", 0)  # (goal, steps it had left) of the call that paused
        self.deadline: float | None = None  # the current time slice's end (awaitable calls); None: no slices

    # ---- goals ---------------------------------------------------------------------------

    def units(self, goal: str, n: int = 0) -> Units:
        """Pull the engine's units towards ``goal`` ("steps" n, "epoch", "train"); yields when the
        time slice (``self.deadline``) is over, so a blocking call never leaves the loop between units.

        Each line here runs once per step (~1 µs each, cold from the model's compute): a step
        unit takes the first branch and four checks."""
        session = self.session
        next_unit, breakpoints, interrupts = session.engine.loop.next_unit, session.breakpoints, self.guard
        steps, last, n_steps = 0, None, n if goal == "steps" else 0
        while True:
            unit = next_unit()
            if isinstance(unit, StepDone):
                steps, last = steps + 1, unit.result
                if breakpoints.matches(last):
                    session.lifecycle.set(Status.PAUSED)
                    return breakpoints.stop_here(last)
                if steps == n_steps:
                    return last
            elif unit is None:  # every epoch is trained
                session.lifecycle.set(Status.FINISHED)
                return last if goal == "steps" else self._last_row()
            else:
                session.history_store.epoch_ended()
                if goal == "epoch":
                    return unit.scores
            if interrupts.requested and not session.engine.all_trained:
                self.paused_goal = (goal, max(n - steps, 0))
                return _PAUSED
            if self.deadline is not None and time.monotonic() >= self.deadline:
                yield

    def advance(self, gen: Units, deadline: float | None) -> tuple[bool, Any]:
        """Drive ``gen`` until it returns (→ (True, value)) or the slice ends at ``deadline`` (→ (False, None))."""
        self.deadline = deadline
        try:
            next(gen)
        except StopIteration as stop:
            return True, stop.value
        return False, None

    def _last_row(self) -> dict[str, Any]:
        engine = self.session.engine
        epochs = engine.scores.epochs if engine.scores is not None else []
        return engine.epoch_scores(epochs[-1]) if epochs else {}

    # ---- running -------------------------------------------------------------------------

    def run(self, goal: str, n: int = 0, *, live: bool | None) -> Any:
        """A blocking train call towards ``goal`` ("steps" ``n``, "epoch", "train"); "train" may find every epoch trained."""
        # the handler is in place before the set-up (model build, resume) so that an interrupt
        # there pauses after the first step instead of tearing the set-up apart
        self.guard.clear()
        # one swap of the session's world (RNG states, torch defaults) for the whole call, set-up included
        with self.guard.held(), self.session.entered():
            self.prepare(live, allow_finished=goal == "train")
            self.mode = "blocking"
            with self.session.engine.loop.driven(goal) as outcome:
                return self.finish(self.drive_all(lambda: self.units(goal, n)), outcome)

    async def run_async(self, goal: str, n: int = 0, *, live: bool | None) -> Any:
        """Like :meth:`run`, in time slices with an ``await`` between them."""
        import asyncio

        self.guard.clear()
        with self.guard.held():
            self.prepare(live, allow_finished=goal == "train")
            self.mode = "awaitable"
            with self.session.engine.loop.driven(goal) as outcome:
                gen = self.units(goal, n)
                while True:
                    deadline = time.monotonic() + self.yield_every_secs
                    # the guard's flag is read as each slice ends (deferred mode), inside the error tracking
                    with self.session.entered(), self.errors_tracked(), self.session.engine.guard.deferred_reads():
                        done, result = self.advance(gen, deadline)
                    if done:
                        return self.finish(result, outcome)
                    await asyncio.sleep(0)  # let the kernel handle widget messages (the Pause button)

    def start_background(self, goal: str, n: int = 0, *, live: bool | None) -> threading.Thread:
        """Like :meth:`run`, in a thread; :meth:`wait` returns its result."""
        if self.thread is not None and self.thread.is_alive():
            raise SessionStateError("this session is already training in the background; call wait() or pause()")
        self.guard.clear()
        self.prepare(live, allow_finished=goal == "train")
        self.background = {}
        self.mode = "background"

        def target() -> None:
            try:
                # finished here, not in wait(): status and the interrupt event come when the thread stops
                with self.session.engine.loop.driven(goal) as outcome:
                    self.background["result"] = self.finish(self.drive_all(lambda: self.units(goal, n)), outcome)
            except BaseException as exc:
                self.background["error"] = exc

        self.thread = threading.Thread(target=target, name="kit-session-training", daemon=True)
        self.thread.start()
        return self.thread

    def wait(self, timeout: float | None) -> Any:
        if self.thread is None:
            return None
        self.thread.join(timeout)
        if self.thread.is_alive():
            return None
        self.thread, outcome = None, self.background
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    def drive_all(self, units: Callable[[], Units]) -> Any:
        with self.session.entered(), self.errors_tracked(), self.session.engine.guard.deferred_reads():
            return self.advance(units(), None)[1]

    def prepare(self, live: bool | None, allow_finished: bool) -> None:
        """Preconditions of every train_* call, and the dashboard when asked."""
        session = self.session
        session.lifecycle.check_can_train()
        with self.forced_interrupt_marked():
            session.ensure_training_parts()
        engine = session.engine
        if not allow_finished and engine.all_trained:
            raise SessionStateError(
                f"all {engine.final_epoch} epochs are trained; "
                "call session.extend(num_epochs) or session.train(num_epochs) to train more"
            )
        session.views.run_starts(live)
        session.lifecycle.set(Status.RUNNING)

    @contextlib.contextmanager
    def forced_interrupt_marked(self) -> Iterator[None]:
        """A KeyboardInterrupt (second interrupt within a second) may leave a half-updated state:
        remember where, so that train_* refuses until restore / reload_latest."""
        try:
            yield
        except KeyboardInterrupt:
            self.session.lifecycle.interrupted_mid_step(self.session.engine.progress)
            raise

    @contextlib.contextmanager
    def errors_tracked(self) -> Iterator[None]:
        """A forced interrupt mid-step marks the session inconsistent; errors set the status."""
        try:
            with self.forced_interrupt_marked():
                yield
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.session.lifecycle.failed(exc)
            self.session.views.run_ended(self.session.status)
            raise

    def finish(self, result: Any, outcome: RunOutcome) -> Any:
        state = self.session.lifecycle
        if result is _PAUSED:
            outcome.value = "paused"
            return self.paused()
        if state.status is Status.PAUSED:  # a break point
            outcome.value = "paused"
        if self.guard.requested:  # it came as the last unit finished: the goal is reached anyway
            logger.info("%s arrived as the train call finished; nothing to pause", self.guard.reason)
            self.guard.clear()
        if state.status is Status.RUNNING:
            state.set(Status.READY)
        self.session.views.run_ended("finished" if state.status is Status.FINISHED else "done")
        return result

    def paused(self) -> Paused:
        session = self.session
        p = session.engine.progress
        goal, left = self.paused_goal
        paused = Paused(p.epoch, p.step_in_epoch, self.guard.reason or "pause requested", goal=goal,
                        steps_left=left, mode=self.mode)
        self.guard.clear()
        session.lifecycle.set(Status.PAUSED)
        # the call returns the note (the cell's result): on stderr too it would show twice, as an error
        logger.info("%s", paused)
        session.events.emit("interrupt", status=paused)
        session.views.run_ended(f"paused at epoch {paused.epoch}, step {paused.step}")
        return paused

    # ---- the final epoch -----------------------------------------------------------------

    def set_final_epoch(self, num_epochs: int, *, lower_ok: bool) -> None:
        engine, state = self.session.engine, self.session.lifecycle
        current = engine.final_epoch
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be an int >= 1, got {num_epochs!r}")
        if num_epochs < current and not lower_ok:
            raise ValueError(
                f"extend(num_epochs={num_epochs}): must be >= the current num_epochs {current}; "
                f"use train(num_epochs={num_epochs}) to stop earlier"
            )
        p = engine.progress
        done = p.epoch if p.epoch_running else p.epoch - 1
        if num_epochs < done:
            raise ValueError(
                f"num_epochs={num_epochs}: epoch {done} is already "
                f"{'running' if p.epoch_running else 'trained'}; the final epoch cannot be earlier"
            )
        engine.final_epoch = num_epochs
        if state.status is Status.FINISHED and num_epochs > done:
            state.set(Status.READY)


def check_n(n: int) -> int:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"train_steps(n): n must be an int >= 1, got {n!r}")
    return n
