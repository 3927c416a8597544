"""``session.dashboard()``: a live view of a training run, built from Session events only.

>>> dash = session.dashboard()                     # doctest: +SKIP
>>> dash                                           # shows the widget (last line of a cell)
>>> await session.train_epoch_async()              # Pause works while this runs

Three renderings, chosen once per dashboard (``mode``):

- ``"widget"`` (in a Jupyter kernel): an ipywidgets view — progress line, status line with a
  Pause button, one PNG image (losses, epoch scores, learning rate, memory) replaced in
  place, and a memory line. Redraws are throttled by wall time; the picture additionally
  takes at most ``plot_budget`` of the wall time: after a first burst of frames (``plot_burst``
  seconds of drawing, for quick feedback), at the default 0.5 %, a frame that only redraws
  the lines (~15 ms) comes every ~3 s, one that redraws the axes too (~70 ms, when the
  data outgrow them) every ~14 s.
  Its mimebundle also carries a static ``image/png`` and a short ``text/plain``, updated
  to the last frame when a run ends, so saved notebooks, nbconvert and GitHub show it.
- ``"terminal"`` (no kernel): a tqdm bar per epoch and a log line per epoch end and pause.
- ``"text"`` (``KIT_WIDGETS_TEXT=1``, or ``KIT_TEST`` set and ``KIT_WIDGETS_TEXT`` unset):
  a deterministic text summary and nothing live, for nbval.

Pause: a button click is a kernel message; a kernel handles it only between cells or
while a cell awaits. So Pause works with ``await session.train_*_async()`` and with
``session.train_in_background()``; the dashboard says so when a blocking ``train_*``
call keeps the kernel busy (an interrupt — Ctrl-C, or the ■ button — always works).

The dashboard never raises into training: an error in one of its views is logged once
and the dashboard detaches itself; training goes on unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import logging
import math
import os
import sys
import threading
import time
from typing import Any

from kit.engine.accounting import losses_device
from kit.widgets.timeline import Timeline, memory_now

logger = logging.getLogger("kit")

EVENTS = ("step_end", "epoch_end", "interrupt", "exception", "checkpoint_saved")
MODES = ("widget", "terminal", "text")
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"

_REACH_NOTES = {
    "responsive": "Pause stops training at the next step boundary; the next train_* call continues.",
    "background": "Training runs in the background: Pause stops it at the next step boundary; "
    "session.wait() returns its result.",
    "blocking": "This cell blocks the kernel, so the Pause button cannot reach it. Interrupt the kernel "
    "(■ or Ctrl-C) to stop at the next step boundary; for a working Pause button train with "
    "<code>await session.train_epoch_async()</code> or <code>session.train_in_background()</code>.",
}


def default_mode() -> str:
    """``text`` under the test switch, ``widget`` in a Jupyter kernel, else ``terminal``."""
    flag = os.environ.get("KIT_WIDGETS_TEXT", "")
    if flag:
        if flag not in ("0", "false", "no"):
            return "text"
    elif os.environ.get("KIT_TEST"):
        return "text"
    return "widget" if _in_kernel() else "terminal"


def _in_kernel() -> bool:
    if "IPython" not in sys.modules:
        return False
    shell = sys.modules["IPython"].get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Dashboard:
    """Live view of a Session (see the module docstring).

    Args:
        session: the :class:`kit.Session` to watch.
        mode: ``"widget"``, ``"terminal"`` or ``"text"``; default from :func:`default_mode`.
        max_redraws_per_sec: wall-time throttle of all redraws.
        plot_budget: the fraction of wall time the picture may take in the long run.
        plot_burst: seconds of drawing allowed at once (refilled at ``plot_budget`` per second).
        smoothing: exponential moving average factor of the smoothed loss curves.
    """

    clock = staticmethod(time.monotonic)  # wall clock of all throttling (tests replace it)

    def __init__(
        self,
        session: Any,
        *,
        mode: str | None = None,
        max_redraws_per_sec: float = 2.0,
        plot_budget: float = 0.005,
        plot_burst: float = 0.1,
        smoothing: float = 0.9,
    ):
        mode = mode or default_mode()
        if mode not in MODES:
            raise ValueError(f"Dashboard mode must be one of {MODES}, got {mode!r}")
        if max_redraws_per_sec <= 0 or not 0 < plot_budget <= 1 or plot_burst < 0:
            raise ValueError(
                f"max_redraws_per_sec must be > 0, plot_budget in (0, 1] and plot_burst >= 0, got "
                f"{max_redraws_per_sec!r}, {plot_budget!r}, {plot_burst!r}"
            )
        self.session = session
        self.mode = mode
        self.min_interval = 1.0 / max_redraws_per_sec
        self.plot_budget = plot_budget
        self.plot_burst = plot_burst
        self.timeline = Timeline(smoothing=smoothing)
        self.num_refreshes = 0  # text redraws
        self.num_plots = 0  # picture redraws
        self.detached = False
        self.error: str | None = None  # why the dashboard detached itself
        # can a Pause click reach the running loop: "responsive", "background" or "blocking"
        self.reach: str | None = None
        self.widget: Any = None
        self._lock = threading.RLock()
        self._loop = _running_loop()
        self._next_refresh = 0.0
        self._next_plot = 0.0
        self._plot_tokens, self._tokens_at = plot_burst, None  # token bucket: seconds of drawing
        self._running = False
        self._run_id = 0
        self._probe: tuple[int, float] | None = None
        self._last_step_at = 0.0
        self._device: Any = None
        self._rss_step = -1
        self._paused: str | None = None
        self._last_checkpoint: str | None = None
        self._train_error: str | None = None
        self._figure: Any = None
        self._frame: bytes | None = None
        self._display: Any = None
        self._terminal: Any = None
        self._prefill()
        self._cell_hook: Any = None
        if mode == "widget":
            try:
                self._build_widget()
                self._watch_cells()
            except ImportError as exc:  # kit installed without the notebook extra
                logger.warning(
                    "dashboard: %s; showing a text progress bar instead (pip install ipywidgets)", exc
                )
                self.mode = mode = "terminal"
        if mode == "terminal":
            from kit.widgets.terminal import TerminalView

            self._terminal = TerminalView()
        self._handlers = [(event, self._guarded(getattr(self, f"_on_{event}"))) for event in EVENTS]
        for event, fn in self._handlers:
            session.on(event, fn)

    def _prefill(self) -> None:
        """Steps and epochs trained before this dashboard was made."""
        history = self.session.history
        if len(history):
            self.timeline.load_history(history.to_dict("records"))
            table = self.session.score_table
            for epoch in table.epochs:
                self.timeline.add_scores(epoch, table.scores(epoch))
            from kit.scores import split_score_key

            self.timeline.error_names |= {split_score_key(k)[1] for k in table.error_keys}

    # ---- the widget -------------------------------------------------------------------

    def _build_widget(self) -> None:
        import ipywidgets as w

        self.status_line = w.HTML()
        self.pause_button = w.Button(
            description="Pause",
            icon="pause",
            tooltip=(
                "stop at the next step boundary (while training runs with await session.train_*_async() "
                "or session.train_in_background())"
            ),
            layout=w.Layout(width="auto"),
        )
        self.pause_button.on_click(self._guarded(self._on_pause_click))
        self.progress_line = w.HTML()
        self.note = w.HTML()
        self.image = w.Image(format="png", layout=w.Layout(width="100%", max_width="1200px"))
        self.memory_line = w.HTML()
        for part, name in [
            (self.status_line, "status"),
            (self.pause_button, "pause"),
            (self.progress_line, "progress"),
            (self.note, "note"),
            (self.image, "loss-plot"),
            (self.memory_line, "memory"),
        ]:
            part.add_class(f"kit-dashboard-{name}")
        self.widget = w.VBox(
            [
                w.HBox([self.pause_button, self.status_line]),
                self.progress_line,
                self.note,
                self.image,
                self.memory_line,
            ]
        )
        self.widget.add_class("kit-dashboard")
        self._update_text()

    # ---- event handlers (the only per-step work) ----------------------------------------

    def _guarded(self, fn: Any) -> Any:
        """Wrap a handler: after an error the dashboard logs one warning and detaches itself."""

        def handler(*args: Any, **payload: Any) -> None:
            if self.detached:
                return
            try:
                fn(*args, **payload)
            except Exception as exc:
                self._detach_after_error(exc)

        handler.__qualname__ = f"Dashboard.{fn.__name__}"
        return handler

    def _on_step_end(self, result: Any, **_: Any) -> None:
        now = self.clock()
        if not self._running:
            self._start_run(result)
        memory = memory_now(self._device, reset_peak=True) if self._cuda else None
        self.timeline.add_step(result, memory, now)
        if self.mode == "widget":
            self._check_reach(now)
            self._last_step_at = now
        if now >= self._next_refresh:
            self.refresh(now=now)

    def _on_epoch_end(self, epoch: int, scores: dict[str, Any], **_: Any) -> None:
        self.timeline.add_scores(epoch, scores)
        if self._terminal is not None:
            self.refresh()
            self._terminal.line(f"epoch {epoch}: " + _format_scores(self.timeline.scores[epoch]))
            self._terminal.close()

    def _on_interrupt(self, status: Any, **_: Any) -> None:
        self._paused = str(status)
        if self._terminal is not None:
            self._terminal.line(self._paused)
        self._finish_run()

    def _on_exception(self, error: BaseException, stage: str = "", **_: Any) -> None:
        self._train_error = f"{type(error).__name__} in {stage or 'training'}: {error}".split("\n")[0]
        if self._terminal is not None:
            self._terminal.line(self._train_error)

    def _on_checkpoint_saved(self, checkpoint: Any, **_: Any) -> None:
        self._last_checkpoint = getattr(checkpoint, "name", str(checkpoint))

    def _on_pause_click(self, _button: Any = None) -> None:
        if self.session.status != "running":
            self.note.value = f"Nothing to pause: the session is {html.escape(self.session.status)}."
            return
        self.session.pause()
        self.pause_button.disabled = True
        self.pause_button.description = "Pausing…"
        self.note.value = "Pause requested: training stops at the next step boundary."

    # ---- runs ---------------------------------------------------------------------------

    def _start_run(self, result: Any) -> None:
        """First step of a train_* call (seen from the step itself: no Session hook needed)."""
        self._running, self._run_id = True, self._run_id + 1
        self._paused = self._train_error = None
        # a run starts when a cell does: its first frames come soon, whatever earlier runs drew
        self._plot_tokens = max(self._plot_tokens, self.plot_burst / 2)
        self._probe, self.reach = None, None
        self.timeline.new_run()
        if self._device is None:
            losses = result.step_losses
            self._device = losses_device(losses) if losses is not None and losses.names else self.session.device
        if self.mode == "widget":
            self.pause_button.disabled, self.pause_button.description = False, "Pause"
            self.widget.remove_class("kit-dashboard-final")
        self._schedule_poll()

    @property
    def _cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

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
            0.2, 4 * getattr(self.session, "yield_every_secs", 0.05)
        ):
            if self.reach != "blocking":
                self.reach, self._next_refresh = "blocking", 0.0  # say so at once

    def _probe_returned(self, run_id: int) -> None:
        if run_id == self._run_id and self._running and self.reach != "blocking":
            self._probe, self.reach = None, "responsive"

    def _watch_cells(self) -> None:
        """In IPython: after each cell, a run that ended in it gets its last frame at once."""
        shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
        if shell is None:
            return

        def after_cell(*_: Any) -> None:
            if self.session.status == "closed":  # nothing more to watch: let go of the shell
                self.detach()
            elif self._running and self.session.status != "running":
                self._finish_run()

        self._cell_hook = (shell, self._guarded(after_cell))
        shell.events.register("post_run_cell", self._cell_hook[1])

    def _schedule_poll(self) -> None:
        """After a run ends (no event says so), draw the last frame from the kernel's loop:
        needed for background runs; in a cell, ``post_run_cell`` comes first."""
        if self._loop is None or self._loop.is_closed():
            return
        poll = self._guarded(self._poll)
        if threading.current_thread() is threading.main_thread():
            self._loop.call_later(0.5, poll)
        else:
            self._loop.call_soon_threadsafe(self._loop.call_later, 0.5, poll)

    def _poll(self) -> None:
        if not self._running:
            return
        if self.session.status == "running":
            self._loop.call_later(0.5, self._guarded(self._poll))
        else:
            self._finish_run()

    def _finish_run(self) -> None:
        """The run ended (paused, finished, failed): last frame, static image in the output."""
        with self._lock:
            self._running = False
            self.refresh(plot=True)
            if self.mode == "widget":
                self.pause_button.disabled, self.pause_button.description = False, "Pause"
                # the last frame is drawn (what a browser test can wait for)
                self.widget.add_class("kit-dashboard-final")
            if self._display is not None:
                self._display.update(self._repr_mimebundle_(), raw=True)
            if self._terminal is not None:
                self._terminal.close()

    # ---- redraw -------------------------------------------------------------------------

    def refresh(self, *, plot: bool = False, now: float | None = None) -> None:
        """Bring the view up to date now (the picture too when ``plot`` or when its time has come)."""
        with self._lock:
            now = self.clock() if now is None else now
            self._next_refresh = now + self.min_interval
            self.timeline.flush()
            last_step = self.timeline.last.get("global_train_step", -1)
            if not self._cuda and last_step != self._rss_step and self.mode != "text":
                self.timeline.add_memory(last_step, memory_now(None))
                self._rss_step = last_step
            self.num_refreshes += 1
            if self.mode == "widget":
                self._update_text()
                if plot or self._plot_due(now):
                    self._update_plot()
            elif self._terminal is not None and self.timeline.last:
                last = self.timeline.last
                self._terminal.update(
                    epoch=last["epoch"],
                    num_epochs=self._num_epochs(),
                    step=last["step"] + 1,
                    frac=last["complete_frac"],
                    postfix=_format_losses(self.timeline),
                )

    def _update_plot(self) -> None:
        if self._figure is None:
            from kit.widgets.plots import DashboardFigure

            self._figure = DashboardFigure()
        start = self.clock()
        self._frame = self._figure.render(self.timeline)
        end = self.clock()
        self.image.value = self._frame
        # the first render also loads fonts and caches: not a measure of the next ones
        self._plot_tokens -= 0.0 if self.num_plots == 0 else end - start
        self.num_plots += 1
        self._next_plot = end + self.min_interval

    def _plot_due(self, now: float) -> bool:
        """At most ``max_redraws_per_sec``, and only while drawing stays within the budget."""
        if now < self._next_plot:
            return False
        if self._tokens_at is not None:
            refill = (now - self._tokens_at) * self.plot_budget
            self._plot_tokens = min(self.plot_burst, self._plot_tokens + refill)
        self._tokens_at = now
        return self._plot_tokens > 0

    def _update_text(self) -> None:
        self.progress_line.value = html.escape(self.progress_text())
        self.status_line.value = f"<b>status: {html.escape(self.status_text())}</b>"
        self.memory_line.value = html.escape(self.memory_text())
        if self._running and self.reach:
            self.note.value = _REACH_NOTES[self.reach]
            self.pause_button.disabled = self.reach == "blocking" or self.pause_button.description != "Pause"
        elif not self._running:
            self.note.value = ""

    # ---- text ---------------------------------------------------------------------------

    def _num_epochs(self) -> int:
        return int(self.session.config.int("num_epochs"))

    def progress_text(self) -> str:
        """epoch, step in epoch, percent, ETA, seconds/step, learning rate, smoothed losses."""
        last = self.timeline.last
        if not last:
            return "no training step yet"
        parts = [f"epoch {last['epoch']}/{self._num_epochs()}", f"step {last['step'] + 1}"]
        frac = last["complete_frac"]
        if frac:
            parts[-1] += f" of ≈{round((last['step'] + 1) / min(frac, 1.0))}"
            parts.append(f"{100 * min(frac, 1.0):.0f}%")
        eta, rate = self.timeline.epoch_eta(), self.timeline.seconds_per_step()
        if eta is not None and self._running:
            parts.append(f"ETA epoch {_format_seconds(eta)}")
        if rate is not None:
            parts.append(f"{rate:.3g} s/step")
        parts.append(f"lr {last['learning_rate']:.3g}")
        losses = _format_losses(self.timeline)
        return " · ".join(parts + ([losses] if losses else []))

    def status_text(self) -> str:
        status = self.session.status
        if self.error:
            return f"{status} (dashboard detached: {self.error})"
        if status == "paused" and self._paused:
            return self._paused
        if status.startswith("error") and self._train_error and self._train_error not in status:
            status += f" ({self._train_error})"
        if self._last_checkpoint:
            status += f" · last checkpoint {self._last_checkpoint}"
        return status

    def memory_text(self) -> str:
        memory = self.timeline.latest_memory() or memory_now(None)
        if "memory_allocated" in memory:
            return "GPU memory: " + " · ".join(
                f"{label} {_format_bytes(memory[key])}"
                for key, label in [
                    ("memory_allocated", "allocated"),
                    ("memory_reserved", "reserved"),
                    ("memory_peak", "step peak"),
                ]
                if key in memory
            )
        return f"memory: process RSS {_format_bytes(memory['memory_rss'])}"

    def summary(self) -> str:
        """A short deterministic summary (no timings): status, position, losses, last scores."""
        self.timeline.flush()
        last = self.timeline.last
        where = (
            f"epoch {last['epoch']}/{self._num_epochs()}, step {last['step'] + 1}"
            if last
            else "no training step yet"
        )
        lines = [f"kit dashboard: {self.session.status}; {where}; {self.timeline.num_steps} steps watched"]
        losses = _format_losses(self.timeline)
        if losses:
            lines.append(f"smoothed losses: {losses}")
        if self.timeline.scores:
            epoch = max(self.timeline.scores)
            lines.append(f"epoch {epoch}: {_format_scores(self.timeline.scores[epoch])}")
        return "\n".join(lines)

    # ---- display --------------------------------------------------------------------------

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        text = self.summary()
        if self.mode != "widget":
            return {"text/plain": text}
        with self._lock:
            if self._frame is None:
                self.refresh(plot=True)
            frame = self._frame
        bundle = self.widget._repr_mimebundle_()
        bundle.update({"text/plain": text, "image/png": base64.b64encode(frame).decode("ascii")})
        return bundle

    def _ipython_display_(self) -> None:
        """Display with a display id, so the static image can be updated to the last frame."""
        from IPython.display import display

        handle = display(self._repr_mimebundle_(), raw=True, display_id=self.mode == "widget")
        if self.mode == "widget":
            self._display = handle

    def __repr__(self) -> str:
        return self.summary()

    # ---- detaching ------------------------------------------------------------------------

    def detach(self) -> None:
        """Stop watching the session (the view keeps its last state)."""
        self.detached = True
        self._running = False
        for event, fn in self._handlers:
            self.session.events.off(event, fn)
        if self._cell_hook is not None:
            shell, hook = self._cell_hook
            with contextlib.suppress(ValueError):
                shell.events.unregister("post_run_cell", hook)
            self._cell_hook = None
        if self._terminal is not None:
            self._terminal.close()

    def _detach_after_error(self, exc: Exception) -> None:
        if self.error is not None:
            return
        self.error = f"{type(exc).__name__}: {exc}".split("\n")[0]
        logger.warning("the dashboard raised %s; it detached itself, training goes on unchanged", self.error)
        self.detach()
        try:
            if self.mode == "widget":
                self.status_line.value = (
                    f"<b>dashboard detached after an error: {html.escape(self.error)}</b>"
                )
        except Exception:  # the view is broken; the log line above says why
            pass


def _format_losses(timeline: Timeline) -> str:
    return " ".join(f"{name} {value:.3g}" for name, value in timeline.latest_losses().items())


def _format_scores(scores: dict[str, float]) -> str:
    keys = [k for k in scores if k != "learning_rate"] or list(scores)
    return " · ".join(f"{k} {scores[k]:.3g}" for k in keys)


def _format_seconds(secs: float) -> str:
    secs = int(round(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def _format_bytes(n: float) -> str:
    if not math.isfinite(n):
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
