"""The dashboard's series: a view over the session's :class:`~kit.session.history.History`.

The history is the one per-step store (its buffer, its flush, its thinning rule); the
timeline reads the rows it has not seen at redraw time and derives what the picture needs:
losses per name, their smoothed curves and the learning rate, thinned whenever the history
thins. Watching a run adds no per-step device sync — one flush per redraw, at most twice a
second. Memory points are the view's own readings of the engine's figures at redraw time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from kit.session.history import NOT_LOSSES, History


class Timeline:
    """Series for the dashboard views; ``add_step`` (a few host values) is the only per-step work.

    Args:
        history: the store to view (a session's); None: a history of its own, fed by ``add_step``.
        max_points: the own history's bound (a session's history has its own).
    """

    def __init__(self, history: History | None = None, *, smoothing: float = 0.9, max_points: int = 20_000):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.smoothing = smoothing
        self.owns_history = history is None
        self.history = History(max_rows=max_points) if history is None else history
        self.max_points = max_points  # also the bound of the memory readings
        self.steps: list[int] = []  # global train step of each point
        self.losses: dict[str, list[float]] = {}  # raw, NaN where a step did not mark that loss
        self.smoothed: dict[str, list[float]] = {}  # bias-corrected exponential moving average
        self.learning_rates: list[float] = []
        self.memory_steps: list[int] = []
        self.memory: dict[str, list[float]] = {}  # "memory_allocated"/... or "memory_rss" -> bytes; NaN where a reading lacks the key
        self.scores: dict[int, dict[str, float]] = {}  # epoch -> score row
        self.error_names: set[str] = set()  # losses marked as_error=True (drawn apart from the others)
        self.num_steps = len(self.history)  # steps seen (not thinned), those before this view included
        self.last: dict[str, Any] = {}  # epoch, step, global_train_step, complete_frac, learning_rate
        self._ema: dict[str, tuple[float, int]] = {}  # name -> (running average, count)
        self._generation = self.history.generation
        self._walls: deque[tuple[float, int]] = deque(maxlen=64)  # (monotonic time, global step)
        self.flush()  # a run watched from its middle: the steps before this view
        if self.history.rows:
            row = self.history.rows[-1]
            self.last = {k: row[k] for k in ("epoch", "step", "global_train_step", "learning_rate")}
            self.last["complete_frac"] = None

    # ---- writing ----------------------------------------------------------------------

    def add_step(self, result: Any, memory: dict[str, int] | None = None, now: float | None = None) -> None:
        """Note one StepResult: position and wall time (the history holds the step itself)."""
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
        if self.owns_history:
            self.history.on_step_end(result)
        if memory:
            self.add_memory(result.global_train_step, memory)

    def add_memory(self, global_step: int, memory: dict[str, int]) -> None:
        self.memory_steps.append(global_step)
        for key, value in memory.items():
            if key not in self.memory:
                self.memory[key] = [math.nan] * (len(self.memory_steps) - 1)
            self.memory[key].append(value)
        for values in self.memory.values():
            if len(values) < len(self.memory_steps):
                values.append(math.nan)
        if len(self.memory_steps) > self.max_points:  # every other reading: the curve keeps its shape
            self.memory_steps = self.memory_steps[::2]
            self.memory = {k: v[::2] for k, v in self.memory.items()}

    def add_scores(self, epoch: int, scores: dict[str, Any]) -> None:
        row = {k: float(v) for k, v in scores.items() if _is_number(v)}
        if set(row) - {"learning_rate"}:  # an epoch not trained yet has a learning rate only
            self.scores[epoch] = row

    def new_run(self) -> None:
        """A new train_* call: do not count the pause before it as step time."""
        self._walls.clear()

    def flush(self) -> None:
        """Bring the series up to the history: its pending losses read (one transfer), new rows appended."""
        history = self.history
        history.flush()
        if history.generation != self._generation:  # the history thinned or rewound: the same rule here
            self._keep({r["global_train_step"] for r in history.rows})
            self._generation = history.generation
        rows, last = history.rows, self.steps[-1] if self.steps else -1
        # up to the last step this view was told of: a view that stopped following keeps its picture
        seen = self.last.get("global_train_step", math.inf) if self.last else math.inf
        start = len(rows)
        while start > 0 and rows[start - 1]["global_train_step"] > last:
            start -= 1
        for row in rows[start:]:
            if row["global_train_step"] > seen:
                break
            self._append(row)

    def _keep(self, steps: set[int]) -> None:
        keep = [i for i, g in enumerate(self.steps) if g in steps]
        self.steps = [self.steps[i] for i in keep]
        self.learning_rates = [self.learning_rates[i] for i in keep]
        for series in (self.losses, self.smoothed):
            for name in series:
                series[name] = [series[name][i] for i in keep]

    def _append(self, row: dict[str, Any]) -> None:
        n = len(self.steps)
        self.steps.append(row["global_train_step"])
        self.learning_rates.append(float(row["learning_rate"]))
        losses = {k: v for k, v in row.items() if k not in _NOT_LOSSES and not k.startswith("memory_")}
        for name in losses:
            if name not in self.losses:  # a loss first marked now: no value before
                self.losses[name], self.smoothed[name] = [math.nan] * n, [math.nan] * n
        for name, raw in self.losses.items():
            value = float(losses.get(name, math.nan))
            raw.append(value)
            self.smoothed[name].append(self._smooth(name, value))

    def _smooth(self, name: str, value: float) -> float:
        avg, count = self._ema.get(name, (0.0, 0))
        if not math.isfinite(value):
            return avg / (1 - self.smoothing**count) if count else math.nan
        beta = self.smoothing
        avg, count = beta * avg + (1 - beta) * value, count + 1
        self._ema[name] = (avg, count)
        return avg / (1 - beta**count)

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


_NOT_LOSSES = NOT_LOSSES


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
