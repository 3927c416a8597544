"""RETURNN's ``stop_for_resubmission_when_low_time_left``: stop between epochs when the scheduler's time runs out.

After each epoch (its training, eval and checkpoint), when the job's time left is less than the last epoch's
wall time × ``stop_for_resubmission_safety_factor`` (default 1.2), training stops instead of starting an
epoch it could not finish; not after the final epoch. The time left is SLURM's, as RETURNN reads it
(``squeue -h -j $SLURM_JOB_ID -O TimeLeft``); outside SLURM, or when ``squeue`` fails, nothing happens.
``python -m kit train`` then writes a step checkpoint, sends SIGINT to the job's process group as RETURNN does
(Sisyphus sees an interrupted job and resubmits it) and exits with status 1; a Session's call returns paused.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kit")

REASON = "low time left"


def parse_slurm_time(text: str) -> int | None:
    """Seconds of a SLURM duration (``[D-]HH:MM:SS``, ``MM:SS``); None when it is not one (``UNLIMITED``)."""
    days, _, rest = text.strip().rpartition("-")
    try:
        parts = [int(x) for x in rest.split(":")]
        d = int(days) if days else 0
    except ValueError:
        return None
    if len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        h, (m, s) = 0, parts
    else:
        return None
    return ((d * 24 + h) * 60 + m) * 60 + s


def slurm_time_left() -> int | None:
    """The SLURM job's seconds left (RETURNN's query); None outside SLURM or when ``squeue`` fails."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-O", "TimeLeft"], check=True, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None
    return parse_slurm_time(out) if out else None


class ResubmissionCheck:
    """Measures each epoch's wall time (``epoch_begin`` → ``epoch_end``) and asks for a stop when it would not fit."""

    def __init__(self, safety_factor: float, request_stop: Callable[[str], None], final_epoch: Callable[[], int],
                 time_left: Callable[[], int | None] = slurm_time_left):
        self.safety_factor = safety_factor
        self._request_stop, self._final_epoch, self._time_left = request_stop, final_epoch, time_left
        self._began: float | None = None

    def attach(self, events: Any) -> ResubmissionCheck:
        events.on("epoch_begin", self.on_epoch_begin)
        events.on("epoch_end", self.on_epoch_end)
        return self

    def on_epoch_begin(self, **_: Any) -> None:
        self._began = time.monotonic()

    def on_epoch_end(self, epoch: int, **_: Any) -> None:
        if self._began is None or epoch >= self._final_epoch():
            return  # a resumed epoch's wall time is unknown; after the final one there is nothing to resubmit
        wall, self._began = time.monotonic() - self._began, None
        left = self._time_left()
        if left is None:
            return
        needed = wall * self.safety_factor
        if left >= needed:
            return
        logger.warning("stop_for_resubmission_when_low_time_left: SLURM time_left=%ds, last epoch wall=%.1fs, "
                       "needed (x%g)=%.1fs -- stopping early so the job can be resubmitted",
                       left, wall, self.safety_factor, needed)
        self._request_stop(REASON)
