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
from collections.abc import Callable, Iterator
from typing import Any

# signal.signal's C function, which the signal module wraps: the wrapper turns the returned handler
# into an enum through a failed lookup (~10 µs warm for a pair, ~120 µs inside a training session's
# cold caches, on every train_* call). The handler set and the one handed back are the same.
_set_handler: Callable[[int, Any], Any]
try:
    from _signal import signal as _set_handler  # type: ignore[import-not-found,no-redef]
except ImportError:  # an interpreter without CPython's _signal: the public wrapper
    _set_handler = signal.signal


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
        previous = _set_handler(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            _set_handler(signal.SIGINT, previous)
