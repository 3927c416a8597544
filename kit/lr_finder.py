"""``session.lr_find()``: an exponential learning-rate sweep that leaves no trace.

The sweep trains ``num_steps`` probe steps on the next training batches (the engine's own
step at the probe's learning rate, :meth:`kit.engine.engine.Engine.probe_step`), the learning
rate growing from ``start_lr`` to ``end_lr`` by the same factor each step, and stops early once
the smoothed loss diverges (non-finite, or more than ``diverge_factor`` times its best). Before it
the engine's training state is captured (:meth:`~kit.engine.engine.Engine.capture`, the snapshot a
checkpoint writes) and put back afterwards, also after an error or an interrupt, so parameters,
optimizer state, RNG states, data position, history and score table are bitwise what they were.
Probe steps emit no events: the session's views never see them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import pandas as pd  # type: ignore[import-untyped]

from kit.errors import KitError, NonFiniteLossError

if TYPE_CHECKING:
    from kit.engine.state import TrainingState
    from kit.engine.step import StepResult


class Probeable(Protocol):
    """What the sweep needs of an engine: a snapshot, a probe step at a given rate, and the undo."""

    def capture(self) -> TrainingState: ...

    def probe_step(self, lr: float) -> StepResult: ...

    def restore_state(self, state: TrainingState, *, announce: bool = True) -> None: ...


class LRFindResult(pd.DataFrame):
    """The sweep: one row per probe step (``lr``, ``loss``, ``smoothed_loss``).

    ``suggestion`` is the learning rate where the smoothed loss falls fastest (steepest
    descent over log lr, before its minimum); ``reason`` says why the sweep stopped;
    ``loss_name`` is the loss that was followed. ``plot()`` draws it; in a notebook the
    result shows the suggestion and the plot above the table.
    """

    _metadata = ["suggestion", "reason", "loss_name"]

    @property
    def _constructor(self) -> type:
        return LRFindResult

    def plot(self, **_: Any) -> Any:  # type: ignore[override]
        """A matplotlib Figure: loss (raw, smoothed) over the learning rate on a log axis."""
        return plot_sweep(self)

    def summary(self) -> str:
        lr = getattr(self, "suggestion", None)
        text = f"suggested learning rate {lr:.3g}" if lr is not None else "no suggestion (too few steps)"
        return f"{text}; {getattr(self, 'reason', '')}"

    def __repr__(self) -> str:
        return self.summary() + "\n" + super().__repr__()

    def _repr_html_(self) -> str:  # type: ignore[override]
        import base64
        import html
        import io

        buf = io.BytesIO()
        self.plot().savefig(buf, format="png")
        img = base64.b64encode(buf.getvalue()).decode("ascii")
        table = pd.DataFrame(self)._repr_html_()
        return (f"<b>{html.escape(self.summary())}</b><br><img src='data:image/png;base64,{img}'/>"
                f"{table}")


def lr_find(engine: Probeable, *, start_lr: float = 1e-7, end_lr: float = 10.0, num_steps: int = 100,
            smoothing: float = 0.9, diverge_factor: float = 4.0, loss: str | None = None) -> LRFindResult:
    """Run the sweep on ``engine`` (set up for training) and put its state back; see the module doc.

    Args:
        loss: the loss name to follow (default: the first loss ``train_step`` marks that is not an error).
    """
    _check_args(start_lr, end_lr, num_steps, smoothing, diverge_factor)
    rows: list[tuple[float, float]] = []
    reason = f"ran all {num_steps} steps"
    name = loss
    snapshot = engine.capture()  # the one undo: put back whatever the sweep does, also on an error
    try:
        ratio = (end_lr / start_lr) ** (1.0 / max(num_steps - 1, 1))
        best, avg = math.inf, 0.0
        for i in range(num_steps):
            lr = start_lr * ratio**i
            try:
                result = engine.probe_step(lr)
            except NonFiniteLossError:
                reason = f"stopped at step {i + 1}: the loss became non-finite at lr {lr:.3g}"
                break
            name, value = _followed(result, name)
            avg = smoothing * avg + (1 - smoothing) * value
            smoothed = avg / (1 - smoothing ** (i + 1))
            rows.append((lr, value))
            if not math.isfinite(smoothed) or smoothed > diverge_factor * best:
                reason = f"stopped at step {i + 1}: the loss diverged at lr {lr:.3g}"
                break
            best = min(best, smoothed)
    finally:
        engine.restore_state(snapshot, announce=False)
    return _result(rows, smoothing, reason, name)


def _check_args(start_lr: float, end_lr: float, num_steps: int, smoothing: float, diverge_factor: float) -> None:
    if not (start_lr > 0 and end_lr > start_lr):
        raise ValueError(f"lr_find: need 0 < start_lr < end_lr, got start_lr={start_lr!r}, end_lr={end_lr!r}")
    if not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"lr_find: num_steps must be an int >= 2, got {num_steps!r}")
    if not 0 <= smoothing < 1 or diverge_factor <= 1:
        raise ValueError(f"lr_find: need 0 <= smoothing < 1 and diverge_factor > 1, got {smoothing!r}, "
                         f"{diverge_factor!r}")


def _followed(result: StepResult, name: str | None) -> tuple[str, float]:
    """The followed loss of a probe step (one device→host read per step: the sweep must see each loss
    to stop at divergence)."""
    losses = result.losses
    if name is None:
        names = [n for n in losses if n not in result.step_losses.errors] or list(losses)
        if not names:
            raise KitError("lr_find: train_step marked no loss")
        name = names[0]
    if name not in losses:
        raise KitError(f"lr_find(loss={name!r}): train_step marked only {', '.join(losses)}")
    return name, losses[name]


def _result(rows: list[tuple[float, float]], smoothing: float, reason: str, name: str | None) -> LRFindResult:
    frame = LRFindResult(rows, columns=["lr", "loss"])
    avg, smoothed = 0.0, []
    for i, value in enumerate(frame["loss"]):
        avg = smoothing * avg + (1 - smoothing) * value
        smoothed.append(avg / (1 - smoothing ** (i + 1)))
    frame["smoothed_loss"] = smoothed
    frame.suggestion = suggest(frame)
    frame.reason = reason
    frame.loss_name = name
    return frame


def suggest(frame: pd.DataFrame) -> float | None:
    """The lr of the steepest fall of the smoothed loss over log lr, before the loss minimum.

    The first tenth of the sweep is left out: there the moving average is still settling and
    the loss barely moves, so noise would pass for a slope.
    """
    import numpy as np

    loss = frame["smoothed_loss"].to_numpy(dtype=float)
    lr = frame["lr"].to_numpy(dtype=float)
    begin = max(2, len(loss) // 10)
    if len(loss) - begin < 3 or not np.isfinite(loss[begin:]).any():
        return None
    end = begin + int(np.nanargmin(np.where(np.isfinite(loss[begin:]), loss[begin:], np.nan))) + 1
    if end - begin < 2:
        return float(lr[begin])
    slope = np.gradient(loss[begin:end], np.log(lr[begin:end]))
    return float(lr[begin + int(np.argmin(slope))])


def plot_sweep(frame: Any) -> Any:
    """Loss over lr (log axis), raw and smoothed, with the suggestion marked; axes fitted to the curve."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kit.widgets.training_plot import PlotFigure

    fig = PlotFigure(figsize=(6, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    name = getattr(frame, "loss_name", None) or "loss"
    ax.plot(frame["lr"], frame["loss"], color="C0", alpha=0.3, lw=0.8, label=f"{name} (raw)")
    ax.plot(frame["lr"], frame["smoothed_loss"], color="C0", lw=1.8, label=f"{name} (smoothed)")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(name)
    smoothed = frame["smoothed_loss"].to_numpy(dtype=float)
    smoothed = smoothed[np.isfinite(smoothed)]
    raw = frame["loss"].to_numpy(dtype=float)
    raw = raw[np.isfinite(raw)]
    if len(smoothed):  # the divergence tail would squash the interesting part: cap at 1.5x the start
        lo = float(min(smoothed.min(), raw.min() if len(raw) else smoothed.min()))
        hi = float(min(smoothed.max(), 1.5 * smoothed[0]))
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.5
        ax.set_ylim(lo - pad, hi + pad)
    lr = getattr(frame, "suggestion", None)
    if lr is not None:
        ax.axvline(lr, color="C3", ls="--", lw=1, label=f"suggestion {lr:.3g}")
    ax.legend(fontsize=9)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    fig.tight_layout()
    return fig
