"""The progress a ``session.train*()`` call shows by default in a notebook: one line, updated in place.

``epoch 2/5 · step 31 of ≈48 · 65% · ETA epoch 0:00:04 · 0.083 s/step · lr 0.01 · ce 0.312 fer 0.121``

One display handle per train call is updated (HF transformers' notebook progress habit: no
``clear_output``, no flicker), at most every ``min_interval`` seconds. Losses are the smoothed
values of :class:`kit.widgets.timeline.Timeline`, read from the device in one transfer per update.
When the call ends the line shows how (finished, paused, failed). Not shown in nbval's text mode
or outside a kernel (see :func:`kit.widgets.dashboard.default_mode`).
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

from kit.widgets.timeline import Timeline


def format_seconds(secs: float) -> str:
    secs = int(round(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def format_losses(timeline: Timeline) -> str:
    return " ".join(f"{name} {value:.3g}" for name, value in timeline.latest_losses().items())


def format_scores(scores: dict[str, float]) -> str:
    keys = [k for k in scores if k != "learning_rate"] or list(scores)
    return " · ".join(f"{k} {scores[k]:.3g}" for k in keys)


def format_bytes(n: float) -> str:
    if not math.isfinite(n):
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_text(memory: dict[str, int]) -> str:
    """CUDA allocated / reserved / step peak, or the process RSS."""
    if "memory_allocated" in memory:
        labels = [("memory_allocated", "allocated"), ("memory_reserved", "reserved"), ("memory_peak", "step peak")]
        return "GPU memory: " + " · ".join(f"{label} {format_bytes(memory[key])}" for key, label in labels
                                           if key in memory)
    return f"memory: process RSS {format_bytes(memory['memory_rss'])}"


def progress_text(timeline: Timeline, num_epochs: int, *, running: bool = True) -> str:
    """epoch, step in epoch, percent, ETA, seconds/step, learning rate, smoothed losses."""
    last = timeline.last
    if not last:
        return "no training step yet"
    parts = [f"epoch {last['epoch']}/{num_epochs}", f"step {last['step'] + 1}"]
    frac = last["complete_frac"]
    if frac:
        parts[-1] += f" of ≈{round((last['step'] + 1) / min(frac, 1.0))}"
        parts.append(f"{100 * min(frac, 1.0):.0f}%")
    eta, rate = timeline.epoch_eta(), timeline.seconds_per_step()
    if eta is not None and running:
        parts.append(f"ETA epoch {format_seconds(eta)}")
    if rate is not None:
        parts.append(f"{rate:.3g} s/step")
    parts.append(f"lr {last['learning_rate']:.3g}")
    losses = format_losses(timeline)
    return " · ".join(parts + ([losses] if losses else []))


class ProgressLine:
    """A live one-line progress view of a Session's train calls (see the module docstring).

    Args:
        session: the :class:`kit.Session` to follow (its events and ``config``).
        min_interval: seconds between updates of the line.
    """

    clock = staticmethod(time.monotonic)
    EVENTS = ("step_end", "epoch_end", "exception")

    def __init__(self, session: Any, *, min_interval: float = 0.5):
        self.session = session
        self.min_interval = min_interval
        self.timeline = Timeline(max_points=2000)
        self.num_updates = 0
        self.text = ""
        self._handle: Any = None
        self._next = 0.0
        self._outcome: str | None = None
        self._handlers = [(event, getattr(self, f"_on_{event}")) for event in self.EVENTS]
        for event, fn in self._handlers:
            session.on(event, fn)

    def start(self) -> None:
        """A train call begins: a new line in the current cell's output."""
        from IPython.display import display

        self.timeline.new_run()
        self._outcome, self._next = None, 0.0
        self._handle = display(self._bundle(), raw=True, display_id=True)

    def finish(self, outcome: str) -> None:
        """The call ended (``outcome``: "finished", "paused at ...", "error: ..."): the line's last state."""
        if not (self._outcome and outcome.startswith("error")):  # an exception event said more already
            self._outcome = outcome
        self.update()
        self._handle = None

    def close(self) -> None:
        for event, fn in self._handlers:
            self.session.events.off(event, fn)

    def _on_step_end(self, result: Any, **_: Any) -> None:
        self.timeline.add_step(result)
        if self._handle is not None and self.clock() >= self._next:
            self.update()

    def _on_epoch_end(self, epoch: int, scores: dict[str, Any], **_: Any) -> None:
        self.timeline.add_scores(epoch, scores)

    def _on_exception(self, error: BaseException, stage: str = "", **_: Any) -> None:
        self._outcome = f"{type(error).__name__} in {stage or 'training'}: {error}".split("\n")[0]
        self.update()

    def update(self) -> None:
        self.timeline.flush()  # one device→host transfer for the steps since the last update
        self._next = self.clock() + self.min_interval
        self.num_updates += 1
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)

    def _bundle(self) -> dict[str, str]:
        self.text = progress_text(self.timeline, int(self.session.config.int("num_epochs")),
                                  running=self._outcome is None)
        if self._outcome:
            self.text += f" · {self._outcome}"
        epochs = sorted(self.timeline.scores)
        if epochs and self._outcome is not None:  # the last finished epoch's scores
            row = self.timeline.scores[epochs[-1]]
            self.text += f" · epoch {epochs[-1]}: " + " ".join(
                f"{k} {v:.3g}" for k, v in row.items() if k != "learning_rate")
        return {"text/plain": self.text,
                "text/html": f"<div class='kit-progress' style='font-family: monospace'>{html.escape(self.text)}</div>"}
