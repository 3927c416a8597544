"""Outside Jupyter: one tqdm bar per epoch and a log line per epoch end, pause or error."""

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

    def update(self, *, epoch: int, num_epochs: int, step: int, frac: float | None, postfix: str) -> None:
        bar = self._bar_for(epoch, num_epochs)
        if bar is None:
            return
        if frac is not None:
            bar.n = round(100 * min(max(frac, 0.0), 1.0), 1)
        bar.set_postfix_str(f"step {step} {postfix}".strip(), refresh=False)
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
            bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}] {postfix}",
            leave=True,
            dynamic_ncols=True,
        )
        self._epoch = epoch
        return self._bar
