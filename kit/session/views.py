"""What a session shows in a notebook while it trains: a live dashboard per train call
(``live=True``), else the one-line progress (``live=None`` in a kernel), and the dashboards it made.

The loop driver calls :meth:`SessionViews.run_starts` and :meth:`SessionViews.run_ended`; the
views themselves live in :mod:`kit.widgets` and read the session through its public API.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kit.session.facade import Session


class SessionViews:
    """The notebook views of one session (none are made before they are needed)."""

    def __init__(self, session: Session, live: bool | None):
        self.session = session
        self.live = live  # the session's default: True dashboard, None progress line in a kernel, False nothing
        self.live_dashboard: Any = None  # the dashboard ``live=True`` showed for the last train call
        self.dashboards: weakref.WeakSet[Any] = weakref.WeakSet()  # every dashboard() of this session
        self.progress_line: Any = None  # the default notebook progress (kit.widgets.progress)

    def dashboard(self) -> Any:
        from kit.widgets import Dashboard

        dashboard = Dashboard(self.session)
        self.dashboards.add(dashboard)
        return dashboard

    def run_starts(self, live: bool | None) -> None:
        """A train call starts: ``live`` (the call's, else the session's) says what to show."""
        want = live if live is not None else self.live
        if want:
            self.show_dashboard()
        elif want is None:
            self.show_progress()

    def run_ended(self, outcome: str) -> None:
        """The train call ended (``outcome``: "done", "finished", "paused at ...", "error: ..."): the line says so."""
        if self.progress_line is not None:
            self.progress_line.finish(outcome)

    def show_progress(self) -> None:
        """The default of a train call in a notebook: a live progress line, unless a dashboard watches."""
        from kit.widgets import progress

        if not progress.wanted() or any(not d.detached for d in self.dashboards):
            return
        if self.progress_line is None:
            self.progress_line = progress.ProgressLine(self.session)
        self.progress_line.start()

    def show_dashboard(self) -> None:
        """Display a live dashboard for this train call (the last call's one stops following)."""
        try:
            from IPython.display import display
        except ImportError:
            return
        # one per call: the one before stops following, so that its cell keeps its own run's last frame
        if self.live_dashboard is not None:
            self.live_dashboard.detach()
        self.live_dashboard = self.dashboard()
        display(self.live_dashboard)
