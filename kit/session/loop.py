"""The train loop of a :class:`kit.Session`: sync, awaitable and background, one mechanism.

Every ``train_*`` call is a generator of "units" (one train step, or one epoch end) driven
to its goal: all at once (``train_*``), in time slices with an ``await`` between them
(``train_*_async``, so widget messages such as the Pause button reach the kernel), or in
a thread (``train_in_background``). Interrupts and Pause stop it at a step boundary.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from kit.engine.engine import StepResult
from kit.errors import SessionStateError

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


def _advance(gen: Generator, deadline: float | None) -> tuple[bool, Any]:
    """Drive ``gen`` until it returns (→ (True, value)) or ``deadline`` passes (→ (False, None))."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return True, stop.value
        if deadline is not None and time.monotonic() >= deadline:
            return False, None


class TrainingLoop:
    """Mixin of :class:`kit.Session` with the ``train_*`` calls (uses the session's engine,
    world, interrupt guard and status)."""

    def train_step(self) -> StepResult | Paused | None:
        """One step of the current epoch (rolling into the next epoch when this one is done)."""
        return self._run(lambda: self._units("steps", 1), live=bool(self.live))  # no progress line for one step

    def train_steps(self, n: int) -> StepResult | Paused | None:
        """``n`` more steps, continuing where the last call stopped; returns the last StepResult."""
        return self._run(lambda: self._units("steps", self._check_n(n)))

    def train_epoch(self, *, live: bool | None = None) -> dict[str, Any] | Paused:
        """Finish the current epoch (or train the next one): steps, scores, eval, checkpoint, LR."""
        return self._run(lambda: self._units("epoch"), live=live)

    def train(self, num_epochs: int | None = None, *, live: bool | None = None) -> dict[str, Any] | Paused:
        """Train up to epoch ``num_epochs`` (default: the config's); returns the last epoch's scores.

        ``num_epochs`` becomes the final epoch (the config's ``num_epochs``), raised or lowered;
        it cannot be below an epoch that is already trained or running.
        """
        if num_epochs is not None:
            self._set_final_epoch(num_epochs, lower_ok=True)
        return self._run(lambda: self._units("train"), live=live, allow_finished=True)

    async def train_steps_async(self, n: int) -> StepResult | Paused | None:
        """Like :meth:`train_steps`, yielding to the event loop between steps (Pause button works)."""
        return await self._run_async(lambda: self._units("steps", self._check_n(n)))

    async def train_epoch_async(self, *, live: bool | None = None) -> dict[str, Any] | Paused:
        """Like :meth:`train_epoch`; ``await`` it in a notebook cell so widgets stay responsive."""
        return await self._run_async(lambda: self._units("epoch"), live=live)

    async def train_async(self, num_epochs: int | None = None, *, live: bool | None = None) -> Any:
        """Like :meth:`train`; ``await session.train_async()`` keeps the kernel responsive."""
        if num_epochs is not None:
            self._set_final_epoch(num_epochs, lower_ok=True)
        return await self._run_async(lambda: self._units("train"), live=live, allow_finished=True)

    def train_in_background(
        self, goal: str = "train", n: int = 1, *, live: bool | None = None
    ) -> threading.Thread:
        """Train in a thread (goal ``"train"``, ``"epoch"`` or ``"steps"``); the cell returns at once.

        ``session.pause()`` stops at the next step boundary, ``session.wait()`` joins and
        returns the result (or raises the error). Do not step other sessions meanwhile:
        global RNG states are process-wide.
        """
        if self._thread is not None and self._thread.is_alive():
            raise SessionStateError(
                "this session is already training in the background; call wait() or pause()"
            )
        units = (
            (lambda: self._units("steps", self._check_n(n)))
            if goal == "steps"
            else (lambda: self._units(goal))
        )
        self._guard.clear()
        self._prepare_run(live, allow_finished=goal == "train")
        self._background = {}
        self._run_mode = "background"

        def target() -> None:
            try:
                # finished here, not in wait(): status and the interrupt event come when the thread stops
                self._background["result"] = self._finish_run(self._drive_all(units))
            except BaseException as exc:
                self._background["error"] = exc

        self._thread = threading.Thread(target=target, name="kit-session-training", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for :meth:`train_in_background`; returns its result or raises its error."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        self._thread, outcome = None, self._background
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    @property
    def is_training(self) -> bool:
        return self.status == "running"

    def extend(self, num_epochs: int) -> None:
        """Raise the final epoch without resetting LR control or history; ``train()`` goes on to it."""
        self._set_final_epoch(num_epochs, lower_ok=False)

    def _set_final_epoch(self, num_epochs: int, *, lower_ok: bool) -> None:
        current = self.config.int("num_epochs")
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be an int >= 1, got {num_epochs!r}")
        if num_epochs < current and not lower_ok:
            raise ValueError(
                f"extend(num_epochs={num_epochs}): must be >= the current num_epochs {current}; "
                f"use train(num_epochs={num_epochs}) to stop earlier"
            )
        p = self.engine.progress
        done = p.epoch if p.epoch_running else p.epoch - 1
        if num_epochs < done:
            raise ValueError(
                f"num_epochs={num_epochs}: epoch {done} is already "
                f"{'running' if p.epoch_running else 'trained'}; the final epoch cannot be earlier"
            )
        self.config.update(num_epochs=num_epochs)
        if self.status == "finished" and num_epochs > done:
            self.status = "ready"

    @staticmethod
    def _check_n(n: int) -> int:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"train_steps(n): n must be an int >= 1, got {n!r}")
        return n

    def _units(self, goal: str, n: int = 0) -> Generator[None, None, Any]:
        """Run train steps / epoch ends towards ``goal``; yields between units."""
        engine, steps, last = self.engine, 0, None
        while True:
            if self._all_trained():
                self.status = "finished"
                return last if goal == "steps" else self._last_row()
            result = engine.train_step()
            if result is None:
                row = engine.finish_epoch()
                if goal == "epoch":
                    return row
            else:
                steps, last = steps + 1, result
                if self._break_matches(result):
                    return self._break_here(result)
                if goal == "steps" and steps >= n:
                    return last
            if self._guard.requested and not self._all_trained():
                self._paused_goal = (goal, max(n - steps, 0))
                return _PAUSED
            yield

    def _all_trained(self) -> bool:
        p = self.engine.progress
        return not p.epoch_running and p.epoch > self.engine.final_epoch

    def _last_row(self) -> dict[str, Any]:
        epochs = self.engine.scores.epochs
        return self.engine.epoch_scores(epochs[-1]) if epochs else {}

    def _run(
        self, units: Callable[[], Generator], *, live: bool | None = None, allow_finished: bool = False
    ) -> Any:
        # the handler is in place before the set-up (model build, resume) so that an interrupt
        # there pauses after the first step instead of tearing the set-up apart
        self._guard.clear()
        with self._guard.held():
            self._prepare_run(live, allow_finished)
            self._run_mode = "blocking"
            return self._finish_run(self._drive_all(units))

    async def _run_async(
        self, units: Callable[[], Generator], *, live: bool | None = None, allow_finished: bool = False
    ) -> Any:
        import asyncio

        self._guard.clear()
        with self._guard.held():
            self._prepare_run(live, allow_finished)
            self._run_mode = "awaitable"
            gen = units()
            while True:
                deadline = time.monotonic() + self.yield_every_secs
                with self._world(), self._errors_tracked(), self.engine.guard.deferred_reads():
                    done, result = _advance(gen, deadline)
                if done:
                    return self._finish_run(result)
                await asyncio.sleep(0)  # let the kernel handle widget messages (the Pause button)

    def _drive_all(self, units: Callable[[], Generator]) -> Any:
        with self._world(), self._errors_tracked(), self.engine.guard.deferred_reads():
            return _advance(units(), None)[1]

    def _prepare_run(self, live: bool | None, allow_finished: bool) -> None:
        """Preconditions of every train_* call, and the dashboard when asked."""
        self._check_can_train()
        with self._forced_interrupt_marked():
            self._training_parts()
        p = self.engine.progress
        if not allow_finished and not p.epoch_running and p.epoch > self.engine.final_epoch:
            raise SessionStateError(
                f"all {self.engine.final_epoch} epochs are trained; "
                "call session.extend(num_epochs) or session.train(num_epochs) to train more"
            )
        want = live if live is not None else self.live
        if want:
            self._show_dashboard()
        elif want is None:
            self._show_progress()
        self.status = "running"

    @contextlib.contextmanager
    def _forced_interrupt_marked(self) -> Iterator[None]:
        """A KeyboardInterrupt (second interrupt within a second) may leave a half-updated state:
        remember where, so that train_* refuses until restore / reload_latest."""
        try:
            yield
        except KeyboardInterrupt:
            self._mid_step = self.engine.progress.where()
            self.status = "error: interrupted mid-step"
            raise

    @contextlib.contextmanager
    def _errors_tracked(self) -> Iterator[None]:
        """A forced interrupt mid-step marks the session inconsistent; errors set the status."""
        try:
            with self._forced_interrupt_marked():
                yield
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.status = f"error: {type(exc).__name__}: {exc}".split("\n")[0]
            self._end_progress(self.status)
            raise

    def _finish_run(self, result: Any) -> Any:
        if result is _PAUSED:
            return self._paused()
        if self._guard.requested:  # it came as the last unit finished: the goal is reached anyway
            logger.info("%s arrived as the train call finished; nothing to pause", self._guard.reason)
            self._guard.clear()
        if self.status == "running":
            self.status = "ready"
        self._end_progress("finished" if self.status == "finished" else "done")
        return result

    def _paused(self) -> Paused:
        p = self.engine.progress
        goal, left = getattr(self, "_paused_goal", ("train", 0))
        paused = Paused(p.epoch, p.step_in_epoch, self._guard.reason or "pause requested", goal=goal,
                        steps_left=left, mode=getattr(self, "_run_mode", "blocking"))
        self._guard.clear()
        self.status = "paused"
        # the call returns the note (the cell's result): on stderr too it would show twice, as an error
        logger.info("%s", paused)
        self.events.emit("interrupt", status=paused)
        self._end_progress(f"paused at epoch {paused.epoch}, step {paused.step}")
        return paused

    def pause(self) -> None:
        """Stop the running train_* call at the next step boundary (e.g. from a button)."""
        self._guard.request("pause requested")

    def _check_can_train(self) -> None:
        if self._inspecting:
            raise SessionStateError(
                f"the model holds the weights of {self._inspecting} for inspection (checkpoints.load); "
                "call session.checkpoints.restore(...) to continue from that checkpoint, or "
                "session.reload_latest() to go back to the training state"
            )
        if self._mid_step:
            raise SessionStateError(
                f"the last train call was interrupted mid-step (a second interrupt within a second) at "
                f"{self._mid_step}: the model or optimizer may be half-updated; call "
                "session.checkpoints.restore(...) or session.reload_latest() to continue from a consistent state"
            )
