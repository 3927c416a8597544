"""``History``: the one per-step store — one row per train step, built from device-side records when read.

Steps append their loss tensors (still on the device); they are copied to the host in one
transfer per ``flush_every`` steps (every ``CPU_FLUSH_EVERY`` when they live on the CPU) or
when someone reads the history. Beyond ``max_rows`` the older rows are thinned out (every
other one, by step number), so a week-long run stays small in memory. Views (the dashboard's
timeline) read these rows; they keep no copy.

Memory columns: ``memory_peak`` (a CUDA step's peak, measured by the engine) on every row;
the memory figures now (``memory_allocated`` / ``memory_reserved``, or ``memory_rss``) on
the row where they were read — every ``flush_every`` steps and at each epoch end, never
inside a step, and the same whether or not a view watches.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kit.engine.accounting import losses_device, read_normalized
from kit.engine.memory import MemoryFigures
from kit.engine.step import StepResult
from kit.events import Event

if TYPE_CHECKING:
    from kit.engine.progress import Progress
    from kit.errors import NonFiniteLossError
    from kit.events import Events

COLUMNS = ["global_train_step", "epoch", "step", "learning_rate", "seconds", "num_seqs"]
NOT_LOSSES = frozenset(COLUMNS) | {"code_version"}  # the columns that are not a loss or an error rate

# Steps whose losses live on the CPU are read every this many (a thousand pending steps held
# ~7000 objects for the garbage collector: measured, a 150 ms full collection every ~6000 steps
# of a small model, ~27 µs per step, and a heap split by their scalars); the memory figures are
# still read every ``flush_every`` steps.
CPU_FLUSH_EVERY = 64


class History:
    """Per-step records: global step, epoch, step, normalized losses, LR, seconds, memory."""

    def __init__(self, max_rows: int = 100_000, flush_every: int = 1000):
        if max_rows < 1:
            raise ValueError(f"history max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.flush_every = flush_every
        self.rows: list[dict[str, Any]] = []
        self.stride = 1  # rows are kept for steps that are multiples of it
        self.generation = 0  # +1 whenever rows are dropped (thinning, rewind): views re-read
        self.memory_source: Callable[[], MemoryFigures | None] | None = None  # the engine's meter
        self.error_names: set[str] = set()  # losses marked as_error (plotted on the error axis)
        # steps not read yet: their rows are built at the flush, in one pass (a dict per step built
        # inside the training loop cost ~10 µs of cold-cache host time), with the memory read then
        self._pending: list[StepResult] = []
        self._pending_memory: dict[int, dict[str, int]] = {}  # position in _pending -> figures read there
        self._flush_at = flush_every  # pending steps that are read at once (fewer on the CPU)
        self._since_memory = 0  # steps since the memory figures were read
        self.code_segments: list[tuple[int, str]] = []  # (first global step, code version): kit.session.hot_edits

    def subscribe(self, events: Events) -> None:
        events.on(Event.STEP_END, self.on_step_end)
        events.on(Event.NONFINITE, self.on_nonfinite)
        events.on(Event.RESTORED, self.on_restored)

    def on_nonfinite(self, error: NonFiniteLossError, **_: Any) -> None:
        """The bad step's update was not applied: it (and, after a rewind, every step after it) leaves the history."""
        if error.global_train_step is not None:
            self.truncate_after(error.global_train_step)

    def on_restored(self, progress: Progress, **_: Any) -> None:
        """The training state went back (a restore, a rewind): the steps from there on leave the history."""
        self.truncate_after(progress.global_train_step)

    def on_step_end(self, result: StepResult, **_: Any) -> None:
        if result.global_train_step % self.stride:
            return
        pending = self._pending
        if not pending:  # losses on the CPU: reading them costs no sync, so they are read sooner
            on_cpu = losses_device(result.step_losses).type == "cpu"
            self._flush_at = min(self.flush_every, CPU_FLUSH_EVERY) if on_cpu else self.flush_every
        pending.append(result)
        if result.step_losses.errors:
            self.error_names |= result.step_losses.errors
        self._since_memory += 1
        if self._since_memory >= self.flush_every:
            self._since_memory = 0
            self._sample_memory(self._pending_memory.setdefault(len(pending) - 1, {}))
            self.flush()
        elif len(pending) >= self._flush_at:
            self.flush()

    def epoch_ended(self) -> None:
        """Memory figures onto the epoch's last row (the session's loop driver calls this)."""
        if self._pending:
            self._sample_memory(self._pending_memory.setdefault(len(self._pending) - 1, {}))
        elif self.rows:
            self._sample_memory(self.rows[-1])

    def _sample_memory(self, row: dict[str, Any]) -> None:
        figures = self.memory_source() if self.memory_source is not None else None
        if figures is not None:
            row.update({k: v for k, v in figures.columns().items() if k not in row})

    @staticmethod
    def _row(result: StepResult, losses: dict[str, float], memory: dict[str, int] | None) -> dict[str, Any]:
        row = {"global_train_step": result.global_train_step, "epoch": result.epoch, "step": result.step,
               "learning_rate": result.learning_rate, "seconds": result.seconds, "num_seqs": result.num_seqs}
        if result.memory_peak is not None:
            row["memory_peak"] = result.memory_peak
        if memory:  # the figures read then; a step's own peak stays the engine's
            row.update({k: v for k, v in memory.items() if k not in row})
        row.update(losses)
        return row

    def flush(self) -> None:
        """Copy pending device records to the host in one transfer."""
        if not self._pending:
            return
        pending, memory = self._pending, self._pending_memory
        self._pending, self._pending_memory = [], {}
        losses = read_normalized([r.step_losses for r in pending])
        row = self._row
        new = [row(r, r.step_losses.reported(lo), memory.get(i)) for i, (r, lo) in enumerate(zip(pending, losses))]
        if self.code_segments:
            starts = [s for s, _ in self.code_segments]
            for r in new:
                i = bisect.bisect_right(starts, r["global_train_step"]) - 1
                r["code_version"] = self.code_segments[i][1] if i >= 0 else None
        self.rows += new
        while len(self.rows) > self.max_rows:
            # keep every other step by number (not by position), so rows stay on the stride's grid
            self.stride *= 2
            self.rows = [r for r in self.rows if r["global_train_step"] % self.stride == 0]
            self.generation += 1

    def truncate_after(self, global_train_step: int) -> None:
        """Forget steps at or after ``global_train_step`` (after a rewind to an earlier state)."""
        self.flush()
        self.rows = [r for r in self.rows if r["global_train_step"] < global_train_step]
        self.generation += 1

    def __len__(self) -> int:
        return len(self.rows) + len(self._pending)

    def to_pandas(self) -> Any:
        import pandas as pd

        self.flush()
        return pd.DataFrame(self.rows, columns=None if self.rows else COLUMNS)
