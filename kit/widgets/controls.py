"""The dashboard's run controls: Pause, Resume, and whether a click can reach the running loop.

A mixin of :class:`kit.widgets.dashboard.Dashboard` (it uses the dashboard's session, widgets,
event loop and run state); see that module's docstring for what Pause and Resume do.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any

from kit.session.lifecycle import Status

if TYPE_CHECKING:
    from kit.session.facade import Session

REACH_NOTES = {
    "responsive": "Pause stops training at the next step boundary; the next train_* call continues.",
    "background": "Training runs in the background: Pause stops it at the next step boundary; "
    "session.wait() returns its result.",
    "blocking": "This cell blocks the kernel, so the Pause button cannot reach it. Interrupt the kernel "
    "(■ or Ctrl-C) to stop at the next step boundary; for a working Pause button train with "
    "<code>await session.train_epoch_async()</code> or <code>session.train_in_background()</code>.",
}


class RunControls:
    """Pause / Resume buttons and the reach probe of a dashboard."""

    session: Session
    note: Any
    pause_button: Any
    resume_button: Any
    reach: str | None
    resume_task: Any
    _loop: Any
    _running: bool
    _run_id: int
    _probe: tuple[int, float] | None
    _last_step_at: float
    _next_refresh: float
    _resumable: Any
    _train_error: str | None

    def _guarded(self, fn: Any) -> Any:
        raise NotImplementedError

    def _on_pause_click(self, _button: Any = None) -> None:
        if self.session.status.kind is not Status.RUNNING:
            self.note.value = f"Nothing to pause: the session is {html.escape(self.session.status)}."
            return
        self.session.pause()
        self.pause_button.disabled = True
        self.pause_button.description = "Pausing…"
        self.note.value = "Pause requested: training stops at the next step boundary."

    def resume_blocker(self) -> str | None:
        """Why Resume cannot continue now (None: it can)."""
        paused = self._resumable
        if paused is None or self.session.status.kind is not Status.PAUSED:
            return None if paused is not None else "Resume continues a paused run; none is paused now."
        if paused.mode == "blocking":
            return ("Resume is off: the paused run was a blocking train_* call, which a button cannot start "
                    "(it would hold the kernel). Continue with the same call in a cell, or "
                    "await session.train_async() to keep Pause and Resume working.")
        if paused.mode == "awaitable" and (self._loop is None or self._loop.is_closed()):
            return "Resume is off: no running event loop to continue the awaitable run on."
        return None

    def _on_resume_click(self, _button: Any = None) -> None:
        why = self.resume_blocker()
        if why:
            self.note.value = html.escape(why)
            self.resume_button.disabled = True
            return
        paused, s = self._resumable, self.session
        self._resumable, self.resume_button.disabled = None, True
        if paused.mode == "background":
            s.train_in_background(paused.goal, max(paused.steps_left, 1))
        else:
            call = {"train": s.train_async, "epoch": s.train_epoch_async}.get(paused.goal)
            coro = call() if call else s.train_steps_async(max(paused.steps_left, 1))
            self.resume_task = self._loop.create_task(coro)
            self.resume_task.add_done_callback(self._guarded(self._resumed))
        self.note.value = f"Resumed ({paused.mode}): continuing from epoch {paused.epoch}, step {paused.step}."

    def _resumed(self, task: Any) -> None:
        """An awaitable run started by Resume ended: its error (if any) in the note, not lost."""
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._train_error = f"{type(error).__name__}: {error}".split("\n")[0]
            self.note.value = html.escape(f"the resumed run failed: {self._train_error}")

    def _check_reach(self, now: float) -> None:
        """Does the kernel's event loop run between steps (then a click gets through)?

        A probe is put on the loop; the awaitable train calls yield to it at the first unit
        boundary after ``session.yield_every_secs``. So when it is still waiting at the end of
        a step that itself ended well after that (the previous one), nothing yields: blocking.
        """
        if threading.current_thread() is not threading.main_thread():
            self.reach = "background"
        elif self._loop is None or not self._loop.is_running():
            self.reach = "blocking"
        elif self._probe is None:
            self._probe = (self._run_id, now)
            self._loop.call_soon(self._probe_returned, self._run_id)
        elif self._last_step_at - self._probe[1] > max(
            0.2, 4 * self.session.info().yield_every_secs
        ):
            if self.reach != "blocking":
                self.reach, self._next_refresh = "blocking", 0.0  # say so at once

    def _probe_returned(self, run_id: int) -> None:
        if run_id == self._run_id and self._running and self.reach != "blocking":
            self._probe, self.reach = None, "responsive"
