"""The loop driver of a :class:`kit.Session`: sync, awaitable and background, one mechanism.

Every ``train_*`` call steps through the engine's loop (:mod:`kit.engine.loop`) unit by
unit towards its goal: all at once (``train_*``), in time slices with an ``await`` between
them (``train_*_async``, so widget messages such as the Pause button reach the kernel), or
in a thread (``train_in_background``). Interrupts, Pause and break points stop it between
two units, at a step boundary. Each call returns one :class:`~kit.session.result.TrainResult`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from kit.engine.debugging import DebugContext
from kit.engine.loop import RunOutcome, StepDone
from kit.errors import SessionStateError
from kit.events import Interrupt
from kit.session.interrupts import InterruptGuard
from kit.session.lifecycle import Status
from kit.session.result import Outcome, TrainResult

if TYPE_CHECKING:
    from kit.engine.step import StepResult
    from kit.session.parts import SessionParts

logger = logging.getLogger("kit")

Units = Generator[None, None, "tuple[Outcome, StepResult | None, DebugContext | None]"]


class LoopDriver:
    """Steps the engine's loop for one session; owns the interrupt guard and the background thread."""

    def __init__(self, parts: SessionParts, yield_every_secs: float = 0.05):
        self.parts = parts
        self.guard = InterruptGuard()
        self.thread: threading.Thread | None = None
        self.background: dict[str, Any] = {}
        self.yield_every_secs = yield_every_secs  # async variants yield to the kernel at most this often
        self.mode = "blocking"  # how the current call runs: "blocking", "awaitable" or "background"
        self.steps_left = 0  # of a "steps" goal that paused
        self.deadline: float | None = None  # the current time slice's end (awaitable calls); None: no slices

    # ---- goals ---------------------------------------------------------------------------

    def units(self, goal: str, n: int = 0) -> Units:
        """Pull the engine's units towards ``goal`` ("steps" n, "epoch", "train"); yields when the time slice
        (``self.deadline``) is over, so a blocking call never leaves the loop between units."""
        parts = self.parts
        next_unit, breakpoints, interrupts = parts.engine.loop.next_unit, parts.breakpoints, self.guard
        steps, last, n_steps = 0, None, n if goal == "steps" else 0
        while True:
            unit = next_unit()
            if isinstance(unit, StepDone):
                steps, last = steps + 1, unit.result
                if breakpoints.matches(last):
                    parts.lifecycle.set(Status.PAUSED)
                    return "break", last, breakpoints.stop_here(last)
                if steps == n_steps:
                    return "done", last, None
            elif unit is None:  # every epoch is trained
                parts.lifecycle.set(Status.FINISHED)
                return "finished", last, None
            else:
                parts.history.epoch_ended()
                if goal == "epoch":
                    return "done", last, None
            if (reason := parts.engine.take_stop_request()) is not None:  # a run tool's (torch_profile, ...)
                interrupts.request(reason)
            if interrupts.requested and not parts.engine.all_trained:
                self.steps_left = max(n - steps, 0)
                return "paused", last, None
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

    # ---- running -------------------------------------------------------------------------

    def run(self, goal: str, n: int = 0, *, live: bool | None) -> TrainResult:
        """A blocking train call towards ``goal`` ("steps" ``n``, "epoch", "train")."""
        # the handler is in place before the set-up (model build, resume) so that an interrupt
        # there pauses after the first step instead of tearing the set-up apart
        self.guard.clear()
        # one swap of the session's world (RNG states, torch defaults) for the whole call, set-up included
        with self.guard.held(), self.parts.entered():
            if (done := self.prepare(goal, live)) is not None:
                return done
            self.mode = "blocking"
            with self.parts.engine.loop.driven(goal) as outcome:
                return self.finish(goal, self.drive_all(lambda: self.units(goal, n)), outcome)

    async def run_async(self, goal: str, n: int = 0, *, live: bool | None) -> TrainResult:
        """Like :meth:`run`, in time slices with an ``await`` between them."""
        import asyncio

        self.guard.clear()
        with self.guard.held():
            with self.parts.entered():
                if (done := self.prepare(goal, live)) is not None:
                    return done
            self.mode = "awaitable"
            with self.parts.engine.loop.driven(goal) as outcome:
                gen = self.units(goal, n)
                while True:
                    deadline = time.monotonic() + self.yield_every_secs
                    # the guard's flag is read as each slice ends (deferred mode), inside the error tracking
                    with self.parts.entered(), self.errors_tracked(), self.parts.engine.driver_call():
                        finished, result = self.advance(gen, deadline)
                    if finished:
                        return self.finish(goal, result, outcome)
                    await asyncio.sleep(0)  # let the kernel handle widget messages (the Pause button)

    def start_background(self, goal: str, n: int = 0, *, live: bool | None) -> threading.Thread:
        """Like :meth:`run`, in a thread; :meth:`wait` returns its result."""
        if self.thread is not None and self.thread.is_alive():
            raise SessionStateError("this session is already training in the background; call wait() or pause()")
        self.guard.clear()
        with self.parts.entered():
            done = self.prepare(goal, live)
        self.background = {} if done is None else {"result": done}
        self.mode = "background"

        def target() -> None:
            try:
                # finished here, not in wait(): status and the interrupt event come when the thread stops
                with self.parts.engine.loop.driven(goal) as outcome:
                    result = self.drive_all(lambda: self.units(goal, n))
                    self.background["result"] = self.finish(goal, result, outcome)
            except BaseException as exc:
                self.background["error"] = exc

        self.thread = threading.Thread(target=target if done is None else lambda: None,
                                       name="kit-session-training", daemon=True)
        self.thread.start()
        return self.thread

    def wait(self, timeout: float | None) -> TrainResult | None:
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
        with self.parts.entered(), self.errors_tracked(), self.parts.engine.driver_call():
            return self.advance(units(), None)[1]

    def prepare(self, goal: str, live: bool | None) -> TrainResult | None:
        """Preconditions of every train_* call, and the dashboard when asked. Every epoch trained already:
        the call's result says so ("finished", nothing left to train) and nothing runs."""
        parts = self.parts
        parts.lifecycle.check_can_train()
        with self.forced_interrupt_marked():
            parts.engine.prepare_training()
        if parts.engine.all_trained:
            parts.lifecycle.set(Status.FINISHED)
            logger.info("all %d epochs are trained: nothing left to train (session.extend(n) or "
                        "session.train(num_epochs=n) trains more)", parts.engine.final_epoch)
            return self.result("finished", goal)
        parts.views.run_starts(live)
        parts.lifecycle.set(Status.RUNNING)
        return None

    @contextlib.contextmanager
    def forced_interrupt_marked(self) -> Iterator[None]:
        """A KeyboardInterrupt (second interrupt within a second) may leave a half-updated state:
        remember where, so that train_* refuses until restore / reload_latest."""
        try:
            yield
        except KeyboardInterrupt:
            self.parts.lifecycle.interrupted_mid_step(self.parts.engine.progress)
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
            self.parts.lifecycle.failed(exc)
            self.parts.views.run_ended(self.parts.lifecycle.text)
            raise

    def finish(self, goal: str, ended: tuple[Outcome, StepResult | None, DebugContext | None],
               outcome: RunOutcome) -> TrainResult:
        kind, last, debug = ended
        state = self.parts.lifecycle
        if kind == "paused":
            outcome.value = "paused"
            return self.paused(goal, last)
        if kind == "break":
            outcome.value = "paused"
        if self.guard.requested:  # it came as the last unit finished: the goal is reached anyway
            logger.info("%s arrived as the train call finished; nothing to pause", self.guard.reason)
            self.guard.clear()
        if state.status is Status.RUNNING:
            state.set(Status.READY)
        self.parts.views.run_ended("finished" if state.status is Status.FINISHED else "done")
        return self.result(kind, goal, last, debug)

    def paused(self, goal: str, last: StepResult | None) -> TrainResult:
        result = self.result("paused", goal, last, reason=self.guard.reason or "pause requested")
        self.guard.clear()
        self.parts.lifecycle.set(Status.PAUSED)
        # the call returns the note (the cell's result): on stderr too it would show twice, as an error
        logger.info("%s", result.summary())
        self.parts.events.emit(Interrupt(result))
        self.parts.views.run_ended(f"paused at epoch {result.epoch}, step {result.step}")
        return result

    def result(self, outcome: Outcome, goal: str, last: StepResult | None = None,
               debug: DebugContext | None = None, reason: str = "") -> TrainResult:
        engine = self.parts.engine
        p, table = engine.progress, engine.scores
        epochs = [e for e in (table.epochs if table is not None else []) if table is not None and table.scores(e)]
        scores_epoch = epochs[-1] if epochs else None
        # train_step() / train_steps(n) done: the position of the call's last step (what their StepResult
        # always said); otherwise where the next step starts (after an epoch, paused, at a break point, ...)
        at = (last.epoch, last.step, last.global_train_step) if outcome == "done" and goal == "steps" \
            and last is not None else (p.epoch, p.step_in_epoch, p.global_train_step)
        return TrainResult(outcome, *at, last,
                           engine.epoch_scores(scores_epoch) if scores_epoch is not None else {}, scores_epoch,
                           debug, reason, goal, self.steps_left if outcome == "paused" else 0, self.mode)

    # ---- the final epoch -----------------------------------------------------------------

    def set_final_epoch(self, num_epochs: int, *, lower_ok: bool) -> None:
        engine, state = self.parts.engine, self.parts.lifecycle
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
        engine.set_final_epoch(num_epochs)
        if state.status is Status.FINISHED and num_epochs > done:
            state.set(Status.READY)


def check_n(n: int) -> int:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"train_steps(n): n must be an int >= 1, got {n!r}")
    return n
