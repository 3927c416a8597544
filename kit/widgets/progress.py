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
import sys
import time
from typing import TYPE_CHECKING, Any

from kit.widgets.formatting import (  # noqa: F401 - this module's names before the split
    format_bytes,
    format_losses,
    format_scores,
    format_seconds,
    memory_text,
    progress_text,
)
from kit.widgets.timeline import Timeline

if TYPE_CHECKING:
    from kit.session.facade import Session


def wanted() -> bool:
    """Whether a train call shows the line: only in a Jupyter kernel (the dashboard's mode rule)."""
    if "IPython" not in sys.modules:  # no kernel without IPython: the rule's answer, without its reads (~20 µs a call)
        return False
    from kit.widgets import dashboard

    return dashboard.default_mode() == "widget"


class ProgressLine:
    """A live one-line progress view of a Session's train calls (see the module docstring).

    Args:
        session: the :class:`kit.Session` to follow (its events, history and final epoch).
        min_interval: seconds between updates of the line.
    """

    clock = staticmethod(time.monotonic)
    EVENTS = ("step_end", "epoch_end", "exception")

    def __init__(self, session: Session, *, min_interval: float = 0.5):
        self.session = session
        self.min_interval = min_interval
        self.timeline = Timeline(session.info().history)  # a view over the session's history
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
            self.session.off(event, fn)

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
        self.text = progress_text(self.timeline, self.session.info().final_epoch,
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
