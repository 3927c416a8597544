"""The dashboard's picture: one matplotlib figure (Agg, no pyplot) rendered to PNG bytes.

Six panels in two rows: losses, error rates (marked ``as_error=True``) and the learning rate
per step; loss scores, error-rate scores per epoch and memory. Losses and error rates never
share a y-axis (a 0.6 loss would flatten a 0.1 error rate). A panel without data says what
will appear there ("scores appear after epoch 1").

The figure and its lines are made once and updated with new data. Axis limits are fitted to
the data with a little headroom (the step axis 10 % of its span) and kept while the data fit
them, so most frames only blit: the saved background (axes, ticks, titles, legends) is
restored and the lines drawn on it — about a fifth of a full draw. A full draw happens only
when data leave the limits, fill too little of them, a legend or a placeholder changes.
Long series are drawn with at most ``max_points`` points.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

LOSSES, ERRORS, LR = "losses per step (raw, smoothed)", "error rates per step", "learning rate"
SCORES, SCORE_ERRORS, MEMORY = "loss scores per epoch", "error-rate scores per epoch", "memory (MiB)"
PANELS = (LOSSES, ERRORS, LR, SCORES, SCORE_ERRORS, MEMORY)
PLACEHOLDERS = {
    LOSSES: "losses appear after the first step",
    ERRORS: "error rates appear here\n(mark_as_loss(..., as_error=True))",
    LR: "appears after the first step",
    SCORES: "scores appear after epoch 1",
    SCORE_ERRORS: "error-rate scores appear after epoch 1",
    MEMORY: "memory appears after the first step",
}
LEGEND_POINTS = 9  # readable at the default size: the figure is shown at about its pixel size
STEP_HEADROOM = 0.1  # of the step span, room before the next full draw
_MIB = 2**20
_MEMORY_LABELS = {
    "memory_allocated": "allocated",
    "memory_reserved": "reserved",
    "memory_peak": "step peak",
    "memory_rss": "process RSS",
}


class DashboardFigure:
    """Two rows of three panels (see the module docstring)."""

    def __init__(self, *, width: float = 12.0, height: float = 5.4, dpi: int = 80, max_points: int = 600):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        self.max_points = max_points
        self.figure = Figure(figsize=(width, height), dpi=dpi)
        FigureCanvasAgg(self.figure)
        self.axes = dict(zip(PANELS, self.figure.subplots(2, 3).ravel()))
        self.figure.subplots_adjust(left=0.05, right=0.99, bottom=0.07, top=0.94, wspace=0.22, hspace=0.38)
        self._placeholders = {}
        for title, ax in self.axes.items():
            ax.set_title(title, fontsize=10)
            ax.tick_params(labelsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True, min_n_ticks=1))  # steps, epochs
            ax.yaxis.set_major_locator(MaxNLocator(4, steps=[1, 2, 2.5, 5, 10]))
            ax.grid(True, lw=0.3, alpha=0.5)
            self._placeholders[title] = ax.text(0.5, 0.5, PLACEHOLDERS[title], ha="center", va="center",
                                                fontsize=10, color="gray", transform=ax.transAxes)
            ax.xaxis.set_visible(False)  # until data come (see _update_placeholder)
            ax.yaxis.set_visible(False)
        self._lines: dict[tuple[str, str], Any] = {}
        self._legend_keys: dict[str, tuple] = {}
        self._background: Any = None  # the figure without its lines, for blitting
        self.num_full_draws = 0

    def render(self, timeline: Any) -> bytes:
        """PNG bytes of the figure for the timeline's current data."""
        errors = set(getattr(timeline, "error_names", ()))
        self._losses(timeline, errors)
        self._scores(timeline, errors)
        self._series(LR, "lr", timeline.steps, timeline.learning_rates, {"color": "tab:purple"}, legend=False)
        for key, values in timeline.memory.items():
            self._series(MEMORY, _MEMORY_LABELS.get(key, key), timeline.memory_steps, [v / _MIB for v in values], {})
        stale = self._background is None
        stale = any([self._update_placeholder(panel) for panel in PANELS]) or stale
        stale = any([self._update_legend(panel) for panel in PANELS]) or stale
        stale = any([self._update_limits(panel, force=stale) for panel in PANELS]) or stale
        canvas: Any = self.figure.canvas  # Agg's: blitting (copy_from_bbox, restore_region)
        if stale:
            canvas.draw()  # lines are "animated": left out of the background
            self._background = canvas.copy_from_bbox(self.figure.bbox)
            self.num_full_draws += 1
        else:
            canvas.restore_region(self._background)
        for (panel, _), line in self._lines.items():
            self.axes[panel].draw_artist(line)
        return _png(canvas)

    def _losses(self, timeline: Any, errors: set[str]) -> None:
        for i, name in enumerate(timeline.losses):
            panel = ERRORS if name in errors else LOSSES
            color = f"C{i % 10}"
            raw_style = {"color": color, "lw": 0.7, "alpha": 0.35}
            self._series(panel, f"{name} raw", timeline.steps, timeline.losses[name], raw_style, legend=False)
            self._series(panel, name, timeline.steps, timeline.smoothed[name], {"color": color, "lw": 1.5})

    def _scores(self, timeline: Any, errors: set[str]) -> None:
        from kit.scores import split_score_key

        epochs = sorted(timeline.scores)
        keys = sorted({k for row in timeline.scores.values() for k in row if k != "learning_rate"})
        for i, key in enumerate(keys):
            style = {"color": f"C{i % 10}", "marker": "o", "ms": 3, "ls": "--" if key.startswith("train") else "-"}
            panel = SCORE_ERRORS if split_score_key(key)[1] in errors else SCORES
            values = [timeline.scores[e].get(key, math.nan) for e in epochs]
            self._series(panel, key, epochs, values, style, thin=False)

    def _series(
        self, panel: str, label: str, x: list, y: list, style: dict, *, legend: bool = True, thin: bool = True
    ) -> None:
        if thin and len(x) > self.max_points:
            k = math.ceil(len(x) / self.max_points)
            x, y = x[::k], y[::k]
        line = self._lines.get((panel, label))
        if line is None:
            (line,) = self.axes[panel].plot(x, y, label=label if legend else f"_{label}", animated=True, **style)
            self._lines[(panel, label)] = line
        else:
            line.set_data(x, y)

    def _update_placeholder(self, panel: str) -> bool:
        """Show the panel's placeholder while it has no finite data; True if that changed."""
        empty = _data_bounds(self.axes[panel].get_lines()) is None
        text = self._placeholders[panel]
        if text.get_visible() == empty:
            return False
        text.set_visible(empty)
        ax = self.axes[panel]
        ax.xaxis.set_visible(not empty)  # no ticks around a placeholder
        ax.yaxis.set_visible(not empty)
        return True

    def _update_legend(self, panel: str) -> bool:
        """Draw the legend if the panel's labels changed; True if it did."""
        ax = self.axes[panel]
        labels = tuple(line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_"))
        if not labels or labels == self._legend_keys.get(panel):
            return False
        # losses and scores fall, memory grows: keep the legend where the newest data is not
        loc = "lower right" if panel == MEMORY else "upper right"
        ax.legend(fontsize=LEGEND_POINTS, loc=loc, ncol=1 + len(labels) // 4, framealpha=0.6)
        self._legend_keys[panel] = labels
        return True

    def _update_limits(self, panel: str, *, force: bool) -> bool:
        """New axis limits if the data left the old ones or fill too little of them; True if changed."""
        ax = self.axes[panel]
        bounds = _data_bounds(ax.get_lines())
        if bounds is None:
            return False
        x_lo, x_hi, y_lo, y_hi = bounds
        if panel in (SCORES, SCORE_ERRORS):  # epochs: a quarter epoch either side
            target_x = (x_lo - 0.25, x_hi + 0.25)
        else:  # steps: a little room to grow before the next full draw
            target_x = (x_lo, x_hi + max(STEP_HEADROOM * (x_hi - x_lo), 1))
        pad = 0.05 * (y_hi - y_lo) or 0.05 * abs(y_hi) or 0.5
        target_y = (y_lo - pad, y_hi + pad)
        if not force:
            views = (ax.get_xlim(), ax.get_ylim())
            fits = all(
                v_lo <= lo and hi <= v_hi
                for (v_lo, v_hi), (lo, hi) in zip(views, ((x_lo, x_hi), (y_lo, y_hi)))
            )
            fills = all(
                v_hi - v_lo <= 2 * (hi - lo) for (v_lo, v_hi), (lo, hi) in zip(views, (target_x, target_y))
            )
            if fits and fills:
                return False
        ax.set_xlim(*target_x)
        ax.set_ylim(*target_y)
        return True


def _data_bounds(lines: list) -> tuple[float, float, float, float] | None:
    """(x min, x max, y min, y max) over the finite points of ``lines``; None if there are none."""
    xs, ys = [], []
    for line in lines:
        x = np.asarray(line.get_xdata(), dtype=float)
        y = np.asarray(line.get_ydata(), dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        xs.append(x[ok])
        ys.append(y[ok])
    x, y = np.concatenate(xs or [np.empty(0)]), np.concatenate(ys or [np.empty(0)])
    if not len(x):
        return None
    return float(x.min()), float(x.max()), float(y.min()), float(y.max())


def _png(canvas: Any) -> bytes:
    """The canvas as PNG bytes (fast zlib level: the picture is replaced within seconds)."""
    from PIL import Image

    width, height = canvas.get_width_height(physical=True)
    image = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="png", compress_level=1)
    return buf.getvalue()
