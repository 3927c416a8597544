"""The dashboard's store: per-step losses, learning rate and memory, per-epoch scores.

Filled from Session events. A step's losses stay on the device until :meth:`Timeline.flush`
(called at redraw time) copies all pending steps to the host in one transfer, so watching
a run adds no per-step device sync — one per redraw, at most twice a second. Beyond ``max_points`` steps every other point is
dropped (the curve keeps its shape, memory stays bounded).
"""

from __future__ import annotations

import math
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import torch

from kit.engine.accounting import read_normalized
from kit.session.history import process_memory_bytes

_HISTORY_KEYS = {"global_train_step", "epoch", "step", "learning_rate", "seconds", "num_seqs"}


class Timeline:
    """Series for the dashboard views; ``add_step`` is the only per-step work."""

    def __init__(self, *, smoothing: float = 0.9, max_points: int = 20_000):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.smoothing = smoothing
        self.max_points = max_points
        self.steps: list[int] = []  # global train step of each point
        self.losses: dict[str, list[float]] = {}  # raw, NaN where a step did not mark that loss
        self.smoothed: dict[str, list[float]] = {}  # bias-corrected exponential moving average
        self.learning_rates: list[float] = []
        self.memory_steps: list[int] = []
        self.memory: dict[str, list[int]] = {}  # "memory_allocated"/... or "memory_rss" -> bytes
        self.scores: dict[int, dict[str, float]] = {}  # epoch -> score row
        self.error_names: set[str] = set()  # losses marked as_error=True (drawn apart from the others)
        self.num_steps = 0  # steps seen (not thinned)
        self.last: dict[str, Any] = {}  # epoch, step, global_train_step, complete_frac, learning_rate
        self._pending: list[tuple[Any, Any]] = []  # (StepResult, memory dict or None)
        self._ema: dict[str, tuple[float, int]] = {}  # name -> (running average, count)
        self._stride = 1
        self._walls: deque[tuple[float, int]] = deque(maxlen=64)  # (monotonic time, global step)

    # ---- writing ----------------------------------------------------------------------

    def add_step(self, result: Any, memory: dict[str, int] | None = None, now: float | None = None) -> None:
        """Record one StepResult (a reference; its losses are read at :meth:`flush`)."""
        self.num_steps += 1
        self.last = {
            "epoch": result.epoch,
            "step": result.step,
            "global_train_step": result.global_train_step,
            "complete_frac": result.complete_frac,
            "learning_rate": result.learning_rate,
        }
        self._walls.append((time.monotonic() if now is None else now, result.global_train_step))
        errors = getattr(result.step_losses, "errors", None)
        if errors and not errors <= self.error_names:
            self.error_names |= errors
        if result.global_train_step % self._stride == 0:
            self._pending.append((result, memory))

    def add_memory(self, global_step: int, memory: dict[str, int]) -> None:
        self.memory_steps.append(global_step)
        for key, value in memory.items():
            if key not in self.memory:
                self.memory[key] = [math.nan] * (len(self.memory_steps) - 1)
            self.memory[key].append(value)
        for values in self.memory.values():
            if len(values) < len(self.memory_steps):
                values.append(math.nan)

    def add_scores(self, epoch: int, scores: dict[str, Any]) -> None:
        row = {k: float(v) for k, v in scores.items() if _is_number(v)}
        if set(row) - {"learning_rate"}:  # an epoch not trained yet has a learning rate only
            self.scores[epoch] = row

    def load_history(self, rows: list[dict[str, Any]]) -> None:
        """Prefill from ``session.history`` records (steps trained before the dashboard existed)."""
        for row in rows:
            losses = {
                k: float(v) for k, v in row.items() if k not in _HISTORY_KEYS and not k.startswith("memory_")
            }
            memory = {k: v for k, v in row.items() if k.startswith("memory_") and v == v}
            step = SimpleNamespace(
                global_train_step=int(row["global_train_step"]), learning_rate=row["learning_rate"]
            )
            self._append(step, {k: v for k, v in losses.items() if v == v}, memory)
        if rows:
            self.num_steps += len(rows)
            last = rows[-1]
            self.last = {
                "epoch": int(last["epoch"]),
                "step": int(last["step"]),
                "global_train_step": int(last["global_train_step"]),
                "complete_frac": None,
                "learning_rate": last["learning_rate"],
            }

    def new_run(self) -> None:
        """A new train_* call: do not count the pause before it as step time."""
        self._walls.clear()

    def flush(self) -> None:
        """Read pending losses from the device (one transfer per loss set) into the series."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = read_normalized([result.step_losses for result, _ in pending])
        for (result, memory), losses in zip(pending, values):
            self._append(result, losses, memory)
        if len(self.steps) > self.max_points:
            self._thin()

    def _append(self, result: Any, losses: dict[str, float], memory: dict[str, int] | None) -> None:
        n = len(self.steps)
        self.steps.append(result.global_train_step)
        self.learning_rates.append(float(result.learning_rate))
        for name in losses:
            if name not in self.losses:  # a loss first marked now: no value before
                self.losses[name], self.smoothed[name] = [math.nan] * n, [math.nan] * n
        for name, raw in self.losses.items():
            value = losses.get(name, math.nan)
            raw.append(value)
            self.smoothed[name].append(self._smooth(name, value))
        if memory:
            self.add_memory(result.global_train_step, memory)

    def _smooth(self, name: str, value: float) -> float:
        avg, count = self._ema.get(name, (0.0, 0))
        if not math.isfinite(value):
            return avg / (1 - self.smoothing**count) if count else math.nan
        beta = self.smoothing
        avg, count = beta * avg + (1 - beta) * value, count + 1
        self._ema[name] = (avg, count)
        return avg / (1 - beta**count)

    def _thin(self) -> None:
        self.steps = self.steps[::2]
        self.learning_rates = self.learning_rates[::2]
        for series in (self.losses, self.smoothed):
            for name in series:
                series[name] = series[name][::2]
        if len(self.memory_steps) > self.max_points:
            self.memory_steps = self.memory_steps[::2]
            for key in self.memory:
                self.memory[key] = self.memory[key][::2]
        self._stride *= 2

    # ---- reading ----------------------------------------------------------------------

    def seconds_per_step(self) -> float | None:
        """Wall time per step (data, step and views) over the recent steps of this run."""
        if len(self._walls) < 2:
            return None
        (t0, g0), (t1, g1) = self._walls[0], self._walls[-1]
        return (t1 - t0) / (g1 - g0) if g1 > g0 else None

    def epoch_eta(self) -> float | None:
        """Seconds until the current epoch's data is used up, from ``complete_frac``."""
        frac, rate = self.last.get("complete_frac"), self.seconds_per_step()
        if not frac or rate is None or frac <= 0:
            return None
        done = self.last["step"] + 1
        return max(0.0, done / min(frac, 1.0) - done) * rate

    def latest_losses(self, smoothed: bool = True) -> dict[str, float]:
        series = self.smoothed if smoothed else self.losses
        return {name: values[-1] for name, values in series.items() if values and math.isfinite(values[-1])}

    def latest_memory(self) -> dict[str, int]:
        return {k: int(v[-1]) for k, v in self.memory.items() if v and math.isfinite(v[-1])}


def memory_now(device: torch.device | None, *, reset_peak: bool = False) -> dict[str, int]:
    """Memory counters now (no device sync); on CUDA optionally starts a new peak window."""
    memory = process_memory_bytes(device)
    if reset_peak and device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return memory


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
