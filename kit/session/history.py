"""``History``: one row per train step, built from device-side records when read.

Steps append their loss tensors (still on the device); they are copied to the host
in one transfer per ``flush_every`` steps or when someone reads the history. Beyond
``max_rows`` the older rows are thinned out (every other one), so a week-long run
stays small in memory.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kit.engine.accounting import read_normalized


def process_memory_bytes(device: torch.device | None) -> dict[str, int]:
    """Memory now: CUDA allocated/reserved/peak (host-side counters, no sync) or process RSS."""
    if device is not None and device.type == "cuda":
        return {
            "memory_allocated": torch.cuda.memory_allocated(device),
            "memory_reserved": torch.cuda.memory_reserved(device),
            "memory_peak": torch.cuda.max_memory_allocated(device),
        }
    return {"memory_rss": _rss_bytes()}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class History:
    """Per-step records: global step, epoch, step, normalized losses, LR, seconds, memory."""

    def __init__(self, max_rows: int = 100_000, flush_every: int = 1000):
        if max_rows < 1:
            raise ValueError(f"history max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.flush_every = flush_every
        self.rows: list[dict[str, Any]] = []
        self._pending: list[tuple[dict[str, Any], Any]] = []  # (row without losses, StepLosses)
        self._stride = 1
        self.device: torch.device | None = None

    def on_step_end(self, result: Any, **_: Any) -> None:
        if result.global_train_step % self._stride:
            return
        row = {
            "global_train_step": result.global_train_step,
            "epoch": result.epoch,
            "step": result.step,
            "learning_rate": result.learning_rate,
            "seconds": result.seconds,
            "num_seqs": result.num_seqs,
            **process_memory_bytes(self.device),
        }
        self._pending.append((row, result.step_losses))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Copy pending device records to the host in one transfer."""
        if not self._pending:
            return
        for (row, _), losses in zip(self._pending, read_normalized([s for _, s in self._pending])):
            row.update(losses)
        self.rows.extend(row for row, _ in self._pending)
        self._pending.clear()
        while len(self.rows) > self.max_rows:
            # keep every other step by number (not by position), so rows stay on the stride's grid
            self._stride *= 2
            self.rows = [r for r in self.rows if r["global_train_step"] % self._stride == 0]

    def truncate_after(self, global_train_step: int) -> None:
        """Forget steps at or after ``global_train_step`` (after a rewind to an earlier state)."""
        self.flush()
        self.rows = [r for r in self.rows if r["global_train_step"] < global_train_step]

    def __len__(self) -> int:
        return len(self.rows) + len(self._pending)

    def to_pandas(self) -> Any:
        import pandas as pd

        self.flush()
        columns = ["global_train_step", "epoch", "step", "learning_rate", "seconds", "num_seqs"]
        return pd.DataFrame(self.rows, columns=None if self.rows else columns)
