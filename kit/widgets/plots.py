"""The dashboard's picture: one matplotlib figure (Agg, no pyplot) rendered to PNG bytes.

Up to six panels: losses, error rates (marked ``as_error=True``) and the learning rate per
step; loss scores, error-rate scores per epoch and memory. Only what the run has gets a panel:
no error-rate panels for a run without error rates, no learning-rate panel while the rate is
constant (the losses panel's title says it: ``lr 0.01``). Losses and error rates never share a
y-axis (a 0.6 loss would flatten a 0.1 error rate); losses spanning more than
``LOG_SPAN`` (max / min) are drawn on a log scale, so a late curve stays readable. A panel
waiting for its first data says what will appear there ("scores appear after epoch 1").
The layout is constrained: tick labels are never clipped.

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
LOG_SPAN = 30.0  # losses whose max / min exceed this are drawn on a log scale
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
        self.max_points = max_points
        self.size, self.dpi = (width, height), dpi
        self.panels: tuple[str, ...] = ()
        self.figure: Any = None
        self.axes: dict[str, Any] = {}
        self.num_full_draws = 0

    def _build(self, panels: tuple[str, ...]) -> None:
        """A figure with these panels (one row up to three, else two rows)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        self.panels = panels
        rows = 1 if len(panels) <= 3 else 2
        cols = math.ceil(len(panels) / rows)
        width, height = self.size
        self.figure = Figure(figsize=(width, height if rows == 2 else height * 0.6), dpi=self.dpi, layout="constrained")
        FigureCanvasAgg(self.figure)
        grid = self.figure.subplots(rows, cols, squeeze=False).ravel()
        for ax in grid[len(panels):]:
            ax.set_visible(False)
        self.axes = dict(zip(panels, grid))
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
        self._log: dict[str, bool] = {}
        self._title: dict[str, str] = {}
        self._background: Any = None  # the figure without its lines, for blitting

    @staticmethod
    def wanted_panels(timeline: Any) -> tuple[str, ...]:
        """The panels this timeline's run has (see the module docstring)."""
        errors = bool(set(getattr(timeline, "error_names", ())) & set(timeline.losses)) or any(
            split_error(k, timeline) for row in timeline.scores.values() for k in row)
        wanted = {LOSSES, SCORES, MEMORY}
        if errors:
            wanted |= {ERRORS, SCORE_ERRORS}
        if constant_lr(timeline) is None and timeline.learning_rates:
            wanted.add(LR)
        return tuple(p for p in PANELS if p in wanted)

    def render(self, timeline: Any) -> bytes:
        """PNG bytes of the figure for the timeline's current data."""
        panels = self.wanted_panels(timeline)
        if panels != self.panels:
            self._build(panels)
        errors = set(getattr(timeline, "error_names", ()))
        self._losses(timeline, errors)
        self._scores(timeline, errors)
        if LR in self.axes:
            self._series(LR, "lr", timeline.steps, timeline.learning_rates, {"color": "tab:purple"}, legend=False)
        lr = constant_lr(timeline)
        self._set_title(LOSSES, LOSSES if lr is None else f"{LOSSES}; lr {lr:.4g}")
        for key, values in timeline.memory.items():
            self._series(MEMORY, _MEMORY_LABELS.get(key, key), timeline.memory_steps, [v / _MIB for v in values], {})
        stale = self._background is None
        stale = any([self._update_placeholder(panel) for panel in self.panels]) or stale
        stale = any([self._update_legend(panel) for panel in self.panels]) or stale
        stale = any([self._update_scale(panel) for panel in self.panels]) or stale
        stale = any([self._update_limits(panel, force=stale) for panel in self.panels]) or stale
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

    def plotted(self, panel: str, label: str) -> tuple[list[float], list[float]]:
        """The (x, y) data a panel's line shows now (tests compare it with the session's history)."""
        line = self._lines[(panel, label)]
        return [float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()]

    def _set_title(self, panel: str, title: str) -> None:
        if self._title.get(panel) != title:
            self.axes[panel].set_title(title, fontsize=10)
            self._title[panel] = title
            self._background = None  # a full draw

    def _update_scale(self, panel: str) -> bool:
        """Log scale for losses spanning more than ``LOG_SPAN`` (positive values only); True if changed."""
        if panel not in (LOSSES, SCORES):
            return False
        ys = [np.asarray(line.get_ydata(), dtype=float) for line in self.axes[panel].get_lines()]
        y = np.concatenate(ys) if ys else np.empty(0)
        y = y[np.isfinite(y)]
        log = bool(len(y)) and float(y.min()) > 0 and float(y.max()) / float(y.min()) > LOG_SPAN
        if self._log.get(panel, False) == log:
            return False
        self._log[panel] = log
        ax = self.axes[panel]
        ax.set_yscale("log" if log else "linear")
        if not log:
            from matplotlib.ticker import MaxNLocator

            ax.yaxis.set_major_locator(MaxNLocator(4, steps=[1, 2, 2.5, 5, 10]))
        return True

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
        if self._log.get(panel):  # a log axis: padding by a factor
            target_y = (y_lo / 1.2, y_hi * 1.2)
        else:
            pad = 0.05 * (y_hi - y_lo) or 0.05 * abs(y_hi) or 0.5
            target_y = (y_lo - pad, y_hi + pad)
        if not force:
            views = (ax.get_xlim(), ax.get_ylim())
            fits = all(
                v_lo <= lo and hi <= v_hi
                for (v_lo, v_hi), (lo, hi) in zip(views, ((x_lo, x_hi), (y_lo, y_hi)))
            )
            scale = [_linear, math.log10 if self._log.get(panel) else _linear]
            fills = all(
                f(v_hi) - f(v_lo) <= 2 * (f(hi) - f(lo))
                for f, (v_lo, v_hi), (lo, hi) in zip(scale, views, (target_x, target_y))
            )
            if fits and fills:
                return False
        ax.set_xlim(*target_x)
        ax.set_ylim(*target_y)
        return True


def _linear(v: float) -> float:
    return v


def constant_lr(timeline: Any) -> float | None:
    """The learning rate when it has been the same at every step so far (None: it changed, or no step yet)."""
    rates = timeline.learning_rates
    if not rates:
        return None
    lo, hi = min(rates), max(rates)
    return hi if hi - lo <= 1e-12 * max(abs(hi), 1e-30) else None


def split_error(key: str, timeline: Any) -> bool:
    """Whether score ``key`` (``dev_loss_fer``) is an error rate of this timeline's run."""
    from kit.scores import split_score_key

    return split_score_key(key)[1] in set(getattr(timeline, "error_names", ()))


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
