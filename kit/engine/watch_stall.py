"""RETURNN's ``torch_watch_stall``: dump the stacks when a train step stops making progress.

``torch_watch_stall = 600`` (seconds) or ``{"timeout": 600, "native": True, "repeat": 3}``; unset, the
environment variable ``RETURNN_WATCH_STALL`` (seconds) switches it on, as in RETURNN. Every train step beats
the heartbeat; a daemon thread looks every ``min(timeout, 30)`` seconds, and when no step began for
``timeout`` seconds it logs ``STALL:`` lines with ``py-spy dump`` of this process (``--native``: the C/C++
frames, which show what a hang inside CUDA or a collective waits for; ``RETURNN_PY_SPY`` names the binary).
Without py-spy it says so and, beyond RETURNN, writes the Python stacks of every thread (``faulthandler``).
At most ``repeat`` dumps, ``timeout`` apart. It never kills anything: a stall is often just a slow step.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, TextIO

logger = logging.getLogger("kit")


def check_options(value: Any) -> str | None:
    """None when ``value`` is a valid ``torch_watch_stall``, else what was expected."""
    if value is None or value is False:
        return None
    timeout = value.get("timeout") if isinstance(value, dict) else value
    known = {"timeout", "native", "repeat"}
    if isinstance(value, dict) and not set(value) <= known:
        return f"a dict of {', '.join(sorted(known))}"
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return None
    return "seconds > 0, or {'timeout': seconds, 'native': bool, 'repeat': int}"


def watch_options(value: Any) -> dict[str, Any] | None:
    """The watcher's options from the config value (or ``RETURNN_WATCH_STALL``); None: no watching."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {"timeout": float(value)}
    if not value and os.environ.get("RETURNN_WATCH_STALL"):
        value = {"timeout": float(os.environ["RETURNN_WATCH_STALL"])}
    return dict(value) if value else None


def find_py_spy() -> str | None:
    """py-spy: ``RETURNN_PY_SPY`` first (often installed outside the training env), else on PATH."""
    path = os.environ.get("RETURNN_PY_SPY")
    return path if path and os.path.exists(path) else shutil.which("py-spy")


class StallWatcher:
    """A daemon thread that dumps the stacks when :meth:`beat` was not called for ``timeout`` seconds."""

    def __init__(self, *, timeout: float, native: bool = True, repeat: int = 3, out: TextIO | None = None,
                 poll: float | None = None):
        self.timeout, self.native, self.repeat = float(timeout), bool(native), int(repeat)
        self._out = out
        self._poll = min(self.timeout, 30.0) if poll is None else poll
        self._last = time.time()
        self.running = False  # watching from a run's begin to its end: set-up and a Session idle between calls are not stalls
        self._stop = threading.Event()
        self.dumps = 0
        self._thread = threading.Thread(target=self._run, name="kit torch_watch_stall", daemon=True)

    def start(self) -> StallWatcher:
        self._thread.start()
        return self

    def beat(self, **_: Any) -> None:
        """Progress: a run or a train step began (subscribed to ``run_begin`` and ``step_begin``)."""
        self._last = time.time()
        self.running = True

    def pause(self, **_: Any) -> None:
        """A run ended (``run_end``): nothing is expected to move until the next one begins."""
        self.running = False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while self.dumps < self.repeat and not self._stop.wait(self._poll):
            idle = time.time() - self._last
            if not self.running or idle < self.timeout:
                continue
            logger.warning("STALL: no progress for %.0fs in pid %d (timeout %.0fs), dumping stacks",
                           idle, os.getpid(), self.timeout)
            self._dump(idle)
            self.dumps += 1
            if self._stop.wait(self.timeout):  # spaced out: a second dump shows whether anything moved
                return
        if self.dumps >= self.repeat:
            logger.warning("STALL: dump limit reached, not watching further")

    def _dump(self, idle: float) -> None:
        py_spy = find_py_spy()
        if py_spy:
            cmd = [py_spy, "dump", "--pid", str(os.getpid())] + (["--native"] if self.native else [])
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                logger.warning("STALL: py-spy dump (idle %.0fs):\n%s%s", idle, done.stdout, done.stderr)
                return
            except (subprocess.TimeoutExpired, OSError) as exc:
                logger.warning("STALL: py-spy failed: %s", exc)
        else:
            logger.warning("STALL: py-spy not found; set RETURNN_PY_SPY=/path/to/py-spy or pip install py-spy; "
                           "the Python stacks of every thread follow")
        faulthandler.dump_traceback(file=self._out or sys.stderr, all_threads=True)
