"""Ctrl-C / "interrupt kernel" held until the step boundary.

While a ``train_*`` call runs, the first SIGINT only sets a flag; the loop checks it
between steps and returns normally ("paused at ..."). A second SIGINT within one
second raises ``KeyboardInterrupt`` at once. Outside the main thread (no signal
handlers there) interrupts are not intercepted and Pause goes through the flag only.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any


class InterruptGuard:
    """A pause flag that SIGINT (or a Pause button) sets; ``held()`` installs the handler."""

    force_window_secs = 1.0

    def __init__(self) -> None:
        self._requested_at: float | None = None
        self.reason = ""

    def request(self, reason: str = "pause requested") -> None:
        """Ask the running loop to stop at the next step boundary (thread-safe)."""
        self.reason = reason
        self._requested_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self._requested_at is not None

    def clear(self) -> None:
        self._requested_at = None
        self.reason = ""

    def _on_sigint(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._requested_at is not None and self.reason == "interrupt" and now - self._requested_at < self.force_window_secs:
            raise KeyboardInterrupt("second interrupt within a second: stopped mid-step")
        self.reason = "interrupt"
        self._requested_at = now

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Install the SIGINT handler for the duration (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
