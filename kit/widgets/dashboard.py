"""``session.dashboard()``: a live view of a training run, built from Session events and public API only.

>>> dash = session.dashboard()                     # doctest: +SKIP
>>> dash                                           # shows the widget (last line of a cell)
>>> await session.train_epoch_async()              # Pause works while this runs

Three renderings, chosen once per dashboard (``mode``):

- ``"widget"`` (in a Jupyter kernel): an ipywidgets view — progress line, status line with
  Pause and Resume buttons, one PNG image (losses and error rates per step, scores per epoch,
  learning rate, memory) replaced in
  place, and a memory line. Redraws are throttled by wall time; the picture additionally
  takes at most ``plot_budget`` of the wall time: after a first burst of frames (``plot_burst``
  seconds of drawing, for quick feedback), at the default 0.5 %, a frame that only redraws
  the lines (~15 ms) comes every ~3 s, one that redraws the axes too (~70 ms, when the
  data outgrow them) every ~14 s.
  Its mimebundle also carries a static ``image/png`` and a short ``text/plain``, updated
  to the last frame when a run ends (the ``run_end`` event: finished, paused or failed),
  so saved notebooks, nbconvert and GitHub show it.
- ``"terminal"`` (no kernel): a tqdm bar per epoch and a log line per epoch end and pause.
- ``"text"`` (``KIT_WIDGETS_TEXT=1``, or ``KIT_TEST`` set and ``KIT_WIDGETS_TEXT`` unset):
  a deterministic text summary and nothing live, for nbval.

Pause: a button click is a kernel message; a kernel handles it only between cells or
while a cell awaits. So Pause works with ``await session.train_*_async()`` and with
``session.train_in_background()``; the dashboard says so when a blocking ``train_*``
call keeps the kernel busy (an interrupt — Ctrl-C, or the ■ button — always works).

Resume: after a pause, continues the paused call's goal in the mode it ran in — in the
background again, or as an awaitable run on the kernel's event loop (``resume_task``).
A blocking call cannot be restarted from a button (it would hold the kernel with no cell
to interrupt); then Resume is disabled and the note says how to continue.

The dashboard never raises into training: an error in one of its views is logged once
and the dashboard detaches itself; training goes on unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import html
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from kit.session.lifecycle import Status
from kit.widgets.controls import REACH_NOTES, RunControls
from kit.widgets.formatting import format_losses, format_scores, memory_text, progress_text
from kit.widgets.timeline import Timeline

if TYPE_CHECKING:
    from kit.session.facade import Session

logger = logging.getLogger("kit")

EVENTS = ("run_begin", "step_end", "epoch_end", "interrupt", "exception", "checkpoint_saved", "run_end")
MODES = ("widget", "terminal", "text")
ISOLATED_GAP_SECS = 0.5  # a run starting later than this after the last one ended stands alone
LONG_RUN_SECS = 1.0  # a run at least this long always ends with its last frame drawn
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"

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


class Dashboard(RunControls):
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
        session: Session,
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
        self.timeline = Timeline(session.info().history, smoothing=smoothing)  # a view over the session's history
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
        # token bucket: seconds of drawing
        self._plot_tokens, self._tokens_at = plot_burst, cast("float | None", None)
        self._running = False
        self._run_id = 0
        self._run_ended_at: float | None = None
        self._run_started_at = 0.0
        self._late_frame: threading.Timer | None = None  # draws a skipped last frame once no run follows
        self._isolated_run = True  # not right after another run: its end always gets the last frame
        self._probe: tuple[int, float] | None = None
        self._last_step_at = 0.0
        self._memory_step = -1
        self._paused: str | None = None
        self._last_checkpoint: str | None = None
        self._train_error: str | None = None
        self._resumable: Any = None  # the Paused note of the last run, while Resume can continue it
        self.resume_task: Any = None  # the asyncio task of an awaitable run started by Resume
        self._displays: list[Any] = []  # one display handle per time this dashboard was shown
        self._figure: Any = None
        self._frame: bytes | None = None
        self._terminal: Any = None
        self.ranks: Any = None  # the per-rank strip (widget mode)
        self._prefill()
        if mode == "widget":
            try:
                self._build_widget()
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
        """Epoch scores of a run trained before this dashboard was made (its steps are in the history)."""
        table = self.session.info().score_table
        if table is not None:
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
        self.resume_button = w.Button(description="Resume", icon="play", disabled=True,
                                      tooltip="continue the paused run", layout=w.Layout(width="auto"))
        self.resume_button.on_click(self._guarded(self._on_resume_click))
        self.progress_line = w.HTML()
        self.note = w.HTML()
        self.image = w.Image(format="png", layout=w.Layout(width="100%", max_width="1200px"))
        self.memory_line = w.HTML()
        from kit.widgets.ranks import RankStrip

        self.ranks = RankStrip(self.session, empty_alone=True)  # one line per worker with processes=N
        for part, name in [
            (self.status_line, "status"),
            (self.pause_button, "pause"),
            (self.resume_button, "resume"),
            (self.progress_line, "progress"),
            (self.note, "note"),
            (self.image, "loss-plot"),
            (self.memory_line, "memory"),
        ]:
            part.add_class(f"kit-dashboard-{name}")
        self.widget = w.VBox(
            [
                w.HBox([self.pause_button, self.resume_button, self.status_line]),
                self.progress_line,
                self.ranks.widget,
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

    def _on_run_begin(self, **_: Any) -> None:
        self._start_run()

    def _on_run_end(self, **_: Any) -> None:
        if self._running:
            self._finish_run()

    def _on_step_end(self, result: Any, **_: Any) -> None:
        now = self.clock()
        if not self._running:  # a step without a run around it (an engine driven by hand)
            self._start_run()
        self.timeline.add_step(result, None, now)
        if self.mode == "widget":
            self._check_reach(now)
            self._last_step_at = now
        if now >= self._next_refresh:
            self.refresh(now=now)

    def _on_epoch_end(self, epoch: int, scores: dict[str, Any], **_: Any) -> None:
        self.timeline.add_scores(epoch, scores)
        if self._terminal is not None:
            self.refresh()
            self._terminal.line(f"epoch {epoch}: " + format_scores(self.timeline.scores[epoch]))
            self._terminal.close()

    def _on_interrupt(self, status: Any, **_: Any) -> None:
        self._paused = str(status)
        self._resumable = status
        if self._terminal is not None:
            self._terminal.line(self._paused)
        if self._running:
            self._finish_run()

    def _on_exception(self, error: BaseException, stage: str = "", **_: Any) -> None:
        self._train_error = f"{type(error).__name__} in {stage or 'training'}: {error}".split("\n")[0]
        if self._terminal is not None:
            self._terminal.line(self._train_error)

    def _on_checkpoint_saved(self, checkpoint: Any, **_: Any) -> None:
        self._last_checkpoint = getattr(checkpoint, "name", str(checkpoint))

    # ---- runs ---------------------------------------------------------------------------

    def _start_run(self) -> None:
        """A train_* call starts (``run_begin``)."""
        self._running, self._run_id = True, self._run_id + 1
        self._cancel_late_frame()
        self._run_started_at = self.clock()
        self._paused = self._train_error = self._resumable = None
        # a run starts when a cell does: its first frames come soon, whatever earlier runs drew;
        # train calls back to back (a loop in one cell) share the budget instead
        ended = self._run_ended_at
        self._isolated_run = ended is None or self.clock() - ended > ISOLATED_GAP_SECS
        if self._isolated_run:
            self._plot_tokens = max(self._plot_tokens, self.plot_burst / 2)
        self._probe, self.reach = None, None
        self.timeline.new_run()
        if self.mode == "widget":
            self.pause_button.disabled, self.pause_button.description = False, "Pause"
            self.widget.remove_class("kit-dashboard-final")

    def _finish_run(self) -> None:
        """The run ended (paused, finished, failed): last frame, static image in the output.

        The picture is drawn for a run that stands alone or lasted ``LONG_RUN_SECS`` (a cell's call);
        after short calls back to back (a loop of ``train_step()``) only within the plot budget, so
        such a loop costs what one long call does — and its last frame is drawn ``ISOLATED_GAP_SECS``
        after the last call, when no other run followed.
        """
        with self._lock:
            self._running = False
            now = self.clock()
            long_run = now - self._run_started_at >= LONG_RUN_SECS
            draw = self._isolated_run or long_run or self._frame is None or self._plot_due(now)
            self.refresh(plot=draw)
            self._run_ended_at = self.clock()
            if self.mode == "widget":
                self.pause_button.disabled, self.pause_button.description = False, "Pause"
                if draw:  # the last frame is drawn (what a browser test can wait for)
                    self.widget.add_class("kit-dashboard-final")
                else:
                    self._schedule_late_frame()
            self._update_displays()
            if self._terminal is not None:
                self._terminal.close()

    def _update_displays(self) -> None:
        if self._displays:
            bundle = self._repr_mimebundle_()
            for handle in self._displays:  # every place it is shown gets this dashboard's last frame
                handle.update(bundle, raw=True)

    def _schedule_late_frame(self) -> None:
        self._cancel_late_frame()
        run_id = self._run_id

        def draw() -> None:
            with self._lock:
                if self._running or self.detached or run_id != self._run_id:
                    return
                try:
                    self.refresh(plot=True)
                    self.widget.add_class("kit-dashboard-final")
                    self._update_displays()
                except Exception as exc:  # a timer thread: nothing above it would log the error
                    self._detach_after_error(exc)

        self._late_frame = threading.Timer(ISOLATED_GAP_SECS, draw)
        self._late_frame.daemon = True
        self._late_frame.start()

    def _cancel_late_frame(self) -> None:
        if self._late_frame is not None:
            self._late_frame.cancel()
            self._late_frame = None

    # ---- redraw -------------------------------------------------------------------------

    def refresh(self, *, plot: bool = False, now: float | None = None) -> None:
        """Bring the view up to date now (the picture too when ``plot`` or when its time has come)."""
        with self._lock:
            now = self.clock() if now is None else now
            self._next_refresh = now + self.min_interval
            self.timeline.flush()
            last_step = self.timeline.last.get("global_train_step", -1)
            if last_step != self._memory_step and self.mode != "text":  # the engine's figures, read now
                memory = self.session.info().memory
                if memory is not None:
                    self.timeline.add_memory(last_step, memory.columns())
                self._memory_step = last_step
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
                    postfix=format_losses(self.timeline),
                    secs_per_step=self.timeline.seconds_per_step(),
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
            self.note.value = REACH_NOTES[self.reach]
            self.pause_button.disabled = self.reach == "blocking" or self.pause_button.description != "Pause"
        elif not self._running:
            why = self.resume_blocker() if self._resumable is not None else None
            self.resume_button.disabled = self._resumable is None or why is not None
            self.resume_button.tooltip = why or "continue the paused run in the mode it ran in"
            self.note.value = html.escape(why) if why else ""
        if self._running:
            self.resume_button.disabled = True

    # ---- text ---------------------------------------------------------------------------

    def _num_epochs(self) -> int:
        return self.session.info().final_epoch

    def progress_text(self) -> str:
        """epoch, step in epoch, percent, ETA, seconds/step, learning rate, smoothed losses."""
        return progress_text(self.timeline, self._num_epochs(), running=self._running)

    def status_text(self) -> str:
        status = str(self.session.status)
        if self.error:
            return f"{status} (dashboard detached: {self.error})"
        state = self.session.status.kind
        if state is Status.PAUSED and self._paused:
            return self._paused
        if state is Status.ERROR and self._train_error and self._train_error not in status:
            status += f" ({self._train_error})"
        if self._last_checkpoint:
            status += f" · last checkpoint {self._last_checkpoint}"
        return status

    def memory_text(self) -> str:
        memory = self.timeline.latest_memory()
        if not memory:
            figures = self.session.info().memory
            memory = figures.columns() if figures is not None else {}
        if not memory:
            return "memory: (not set up yet)"
        return memory_text(memory)

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
        losses = format_losses(self.timeline)
        if losses:
            lines.append(f"smoothed losses: {losses}")
        if self.timeline.scores:
            epoch = max(self.timeline.scores)
            lines.append(f"epoch {epoch}: {format_scores(self.timeline.scores[epoch])}")
        return "\n".join(lines)

    # ---- display --------------------------------------------------------------------------

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        text = self.summary()
        if self.mode != "widget":
            return {"text/plain": text}
        with self._lock:
            if self._frame is None:
                self.refresh(plot=True)
            frame = self._frame or b""
        bundle = self.widget._repr_mimebundle_()
        bundle.update({"text/plain": text, "image/png": base64.b64encode(frame).decode("ascii")})
        return bundle

    def _ipython_display_(self) -> None:
        """Display with a display id, so the static image can be updated to the last frame."""
        from IPython.display import display

        handle = display(self._repr_mimebundle_(), raw=True, display_id=self.mode == "widget")
        if self.mode == "widget":
            self._displays.append(handle)

    def __repr__(self) -> str:
        return self.summary()

    # ---- detaching ------------------------------------------------------------------------

    def detach(self) -> None:
        """Stop watching the session (the view keeps its last state)."""
        self.detached = True
        self._running = False
        self._cancel_late_frame()
        for event, fn in self._handlers:
            self.session.off(event, fn)
        if self.ranks is not None:
            self.ranks.close()
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
