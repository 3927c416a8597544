"""The per-rank strip of a session that trains on worker processes (``session.train(processes=N)``).

One line per rank — epoch, step, global step, steps per second, memory, device — read from
:func:`kit.multiproc.rank_status` (public API) whenever a step ends, at most every ``every`` seconds.
The dashboard embeds :attr:`RankStrip.widget`; alone, show the strip as a cell's last line.
"""

from __future__ import annotations

import html
import time
from typing import Any

from kit.events import Event


class RankStrip:
    """A live HTML strip of the workers' status lines (empty while the session trains in this process)."""

    def __init__(self, session: Any, every: float = 0.25, *, empty_alone: bool = False):
        import ipywidgets

        # empty_alone: no line at all while the session trains in this process (inside the dashboard)
        self.session, self.every, self.empty_alone = session, every, empty_alone
        self.widget = ipywidgets.HTML(self.html(), layout={"width": "100%"})
        self.drawn_at = 0.0
        session.on(Event.STEP_END, self.on_step_end)
        session.on(Event.RUN_END, self.refresh)

    def on_step_end(self, **_: Any) -> None:
        if time.monotonic() - self.drawn_at >= self.every:
            self.refresh()

    def refresh(self, **_: Any) -> None:
        self.drawn_at = time.monotonic()
        self.widget.value = self.html()

    def html(self) -> str:
        """The strip as an HTML table (a line saying there are no workers without them)."""
        from kit import multiproc

        statuses = multiproc.rank_status(self.session)
        if not statuses:
            return "" if self.empty_alone else "<i>no worker processes (train with processes=N)</i>"
        rows = []
        for rank in sorted(statuses):
            s = statuses[rank]
            memory = f"{s.memory_bytes / 2**20:.0f} MiB" if s.memory_bytes else ""
            cells = (f"rank {rank}", html.escape(s.device), f"epoch {s.epoch}", f"step {s.step}",
                     f"global {s.global_train_step}", f"{s.steps_per_sec:.1f} steps/s", memory)
            rows.append("<tr>" + "".join(f"<td style='padding:0 8px'>{c}</td>" for c in cells) + "</tr>")
        return "<table class='kit-ranks'>" + "".join(rows) + "</table>"

    def close(self) -> None:
        self.session.off(Event.STEP_END, self.on_step_end)
        self.session.off(Event.RUN_END, self.refresh)
        self.widget.close()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
