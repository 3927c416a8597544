"""Outside Jupyter: one tqdm bar per epoch (a Session's terminal dashboard, the CLI on a TTY) and log lines."""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("kit")


class TerminalView:
    """A tqdm bar in percent of the epoch (``complete_frac``); plain log lines without tqdm."""

    def __init__(self, file: Any = None):
        self.file = file if file is not None else sys.stderr
        self._bar: Any = None
        self._epoch: int | None = None

    def update(self, *, epoch: int, num_epochs: int, step: int, frac: float | None, postfix: str,
               secs_per_step: float | None = None) -> None:
        """``secs_per_step``: wall clock per step over the recent steps (what the log line's sec/step counts)."""
        bar = self._bar_for(epoch, num_epochs)
        if bar is None:
            return
        if frac is not None:
            bar.n = round(100 * min(max(frac, 0.0), 1.0), 1)
        rate = f", {secs_per_step:.4g} s/step" if secs_per_step is not None else ""
        bar.set_postfix_str(f"step {step}{rate} {postfix}".strip(), refresh=False)
        bar.refresh()

    def line(self, text: str) -> None:
        """A log line that does not break the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.file)
        else:
            logger.info("%s", text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._epoch = None, None

    def _bar_for(self, epoch: int, num_epochs: int) -> Any:
        if self._bar is not None and self._epoch == epoch:
            return self._bar
        self.close()
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        self._bar = tqdm(
            total=100,
            desc=f"epoch {epoch}/{num_epochs}",
            unit="%",
            file=self.file,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]{postfix}",
            leave=True,
            dynamic_ncols=True,
        )
        self._epoch = epoch
        return self._bar


class TerminalProgress:
    """``python -m kit train`` on a terminal: a tqdm bar per epoch (epoch, step, percent, ETA, smoothed
    losses), fed by the engine's events and redrawn at most every ``min_interval`` seconds; the
    log lines go above it (see :meth:`logging_redirected`).

    Args:
        events: the engine's :class:`kit.events.Events`.
        num_epochs: returns the final epoch (the config may change it).
        is_main: returns False on torchrun ranks > 0 (they show nothing).
    """

    def __init__(self, events: Any, num_epochs: Any, *, is_main: Any = lambda: True, file: Any = None,
                 min_interval: float = 0.25):
        from kit.widgets.timeline import Timeline

        self.view = TerminalView(file)
        self.timeline = Timeline(max_points=2000)
        self.num_epochs, self.is_main, self.min_interval = num_epochs, is_main, min_interval
        self._next = 0.0
        self._events = events
        self._handlers: list[tuple[str, Any]] = [("step_end", self._on_step_end), ("epoch_end", self._on_epoch_end)]
        for event, fn in self._handlers:
            events.on(event, fn)

    def _on_step_end(self, result: Any, **_: Any) -> None:
        if not self.is_main():
            return
        self.timeline.add_step(result)
        import time

        now = time.monotonic()
        if now >= self._next or result.complete_frac == 1:
            self._next = now + self.min_interval
            self.timeline.flush()  # one device→host transfer for the steps since the last redraw
            from kit.widgets.formatting import format_losses

            last = self.timeline.last
            self.view.update(epoch=last["epoch"], num_epochs=int(self.num_epochs()), step=last["step"] + 1,
                             frac=last["complete_frac"], postfix=format_losses(self.timeline),
                             secs_per_step=self.timeline.seconds_per_step())

    def _on_epoch_end(self, epoch: int, **_: Any) -> None:
        self.view.close()  # the finished epoch's bar stays; the engine logs its scores below it

    def logging_redirected(self) -> Any:
        """A context in which the ``kit`` log lines are written above the bar instead of through it."""
        import contextlib

        try:
            from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]
        except ImportError:
            return contextlib.nullcontext()
        return logging_redirect_tqdm(loggers=[logging.getLogger()])  # kit's records reach the root handler

    def close(self) -> None:
        for event, fn in self._handlers:
            self._events.off(event, fn)
        self.view.close()
