"""``session.plot()``: losses per step and scores per epoch — the picture users would draw themselves.

Panels (matplotlib, no pyplot): losses per step (raw, faint, and smoothed), error rates per
step on their own axes (a 0.6 loss would flatten a 0.1 error rate), and the scores per epoch,
losses and error rates again apart. Axes are fitted to the data with a little headroom; the
raw curve's outliers (the first steps of a run) do not stretch the y-axis. Memory and timing
columns of the history are not drawn.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from kit.session.history import NOT_LOSSES

HISTORY_COLUMNS = NOT_LOSSES


class PlotFigure(Figure):
    """A matplotlib Figure that shows itself as PNG in a notebook without pyplot."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png")
        return buf.getvalue()


def loss_columns(history: Any) -> list[str]:
    """The loss columns of a history frame (not counters, learning rate, timings or memory)."""
    return [c for c in history.columns if c not in HISTORY_COLUMNS and not str(c).startswith("memory_")]


def smooth(values: np.ndarray, beta: float) -> np.ndarray:
    """Bias-corrected exponential moving average; NaNs are skipped (the average carries on)."""
    out, avg, count = np.empty(len(values)), 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            avg, count = beta * avg + (1 - beta) * v, count + 1
        out[i] = avg / (1 - beta**count) if count else math.nan
    return out


def plot_training(history: Any, scores: Any, *, error_names: set[str], smoothing: float = 0.9,
                  width: float = 11.0) -> PlotFigure:
    """The figure for a history frame (one row per step) and a score frame (one row per epoch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    losses = loss_columns(history)
    kinds = [("losses", [n for n in losses if n not in error_names]), ("error rates", [n for n in losses if n in error_names])]
    kinds = [(title, names) for title, names in kinds if names] or [("losses", [])]
    fig = PlotFigure(figsize=(width, 3.0 * 2), dpi=90)
    FigureCanvasAgg(fig)
    grid = fig.subplots(2, len(kinds), squeeze=False)
    steps = history["global_train_step"].to_numpy(dtype=float) if len(history) else np.empty(0)
    for col, (title, names) in enumerate(kinds):
        _step_panel(grid[0][col], f"{title} per step", steps, history, names, smoothing)
        keys = [k for k in scores.columns if _score_name(k) in names] if len(scores) else []
        _epoch_panel(grid[1][col], f"{title} per epoch", scores, keys)
    _mark_epochs(grid[0], history)
    fig.tight_layout()
    return fig


def _step_panel(ax: Any, title: str, steps: np.ndarray, history: Any, names: list[str], beta: float) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("global train step", fontsize=10)
    if not len(steps) or not names:
        _placeholder(ax, "no train step yet" if not len(steps) else "nothing marked")
        return
    ys = []
    for i, name in enumerate(names):
        raw = history[name].to_numpy(dtype=float)
        smoothed = smooth(raw, beta)
        ax.plot(steps, raw, color=f"C{i}", lw=0.7, alpha=0.3)
        ax.plot(steps, smoothed, color=f"C{i}", lw=1.6, label=f"{name} (smoothed)")
        ys += [raw, smoothed]
    _fit(ax, steps, np.concatenate(ys), robust=True)
    ax.legend(fontsize=9, loc="upper right")


def _epoch_panel(ax: Any, title: str, scores: Any, keys: list[str]) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("epoch", fontsize=10)
    frame = scores[keys].dropna(how="all") if keys else scores.iloc[0:0]
    if not len(frame):
        _placeholder(ax, "scores appear after epoch 1")
        return
    epochs = frame.index.to_numpy(dtype=float)
    for i, key in enumerate(keys):
        ax.plot(epochs, frame[key].to_numpy(dtype=float), marker="o", ms=4, color=f"C{i}",
                ls="--" if key.startswith("train") else "-", label=key)
    ax.set_xlim(epochs.min() - 0.5, epochs.max() + 0.5)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _fit(ax, None, frame.to_numpy(dtype=float).ravel(), robust=False)
    ax.legend(fontsize=9, loc="upper right")


def _fit(ax: Any, x: np.ndarray | None, y: np.ndarray, *, robust: bool) -> None:
    """Axes to the data with 5 % headroom; ``robust``: the y range of the 1st..99th percentile."""
    y = y[np.isfinite(y)]
    if x is not None and len(x):
        ax.set_xlim(float(x.min()), float(x.max()) if x.max() > x.min() else float(x.min()) + 1)
    if not len(y):
        return
    lo, hi = (np.percentile(y, [1, 99]) if robust and len(y) > 20 else (y.min(), y.max()))
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.5
    ax.set_ylim(float(lo - pad), float(hi + pad))
    ax.grid(True, lw=0.3, alpha=0.5)
    ax.tick_params(labelsize=9)


def _mark_epochs(axes: Any, history: Any) -> None:
    """A faint line where each epoch starts (after the first)."""
    if not len(history):
        return
    first = history.groupby("epoch")["global_train_step"].min()
    for ax in axes:
        for step in first.iloc[1:]:
            ax.axvline(step, color="gray", lw=0.6, alpha=0.4)


def _placeholder(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="gray", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _score_name(key: str) -> str:
    from kit.scores import split_score_key

    return split_score_key(key)[1]
