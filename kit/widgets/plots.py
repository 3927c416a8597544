"""The dashboard's picture: one matplotlib figure (Agg, no pyplot) rendered to PNG bytes.

The figure and its lines are made once and updated with new data. Axis limits grow with
headroom (the step axis by half its span) and are kept while the data fits them, so
most frames only blit: the saved background (axes, ticks, titles, legends) is restored and
the lines drawn on it — about a fifth of a full draw. A full draw happens only when data
leaves the limits, fills too little of them, or a legend changes: a few times per run.
Long series are drawn with at most ``max_points`` points.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

PANELS = ("loss (raw, smoothed)", "scores per epoch", "learning rate", "memory (MiB)")
_MIB = 2**20
_MEMORY_LABELS = {
    "memory_allocated": "allocated",
    "memory_reserved": "reserved",
    "memory_peak": "step peak",
    "memory_rss": "process RSS",
}


class DashboardFigure:
    """Four panels in a row: losses, epoch scores, learning rate, memory."""

    def __init__(self, *, width: float = 12.0, height: float = 2.7, dpi: int = 80, max_points: int = 600):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        self.max_points = max_points
        self.figure = Figure(figsize=(width, height), dpi=dpi)
        FigureCanvasAgg(self.figure)
        self.axes = dict(zip(PANELS, self.figure.subplots(1, len(PANELS))))
        self.figure.subplots_adjust(left=0.04, right=0.995, bottom=0.13, top=0.89, wspace=0.28)
        for title, ax in self.axes.items():
            ax.set_title(title, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(4, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(3))
            ax.grid(True, lw=0.3, alpha=0.5)
        self._lines: dict[tuple[str, str], Any] = {}
        self._legend_keys: dict[str, tuple] = {}
        self._background: Any = None  # the figure without its lines, for blitting
        self.num_full_draws = 0
        self._waiting = self.axes[PANELS[0]].text(
            0.5,
            0.5,
            "waiting for the first step",
            ha="center",
            va="center",
            fontsize=9,
            color="gray",
            transform=self.axes[PANELS[0]].transAxes,
        )

    def render(self, timeline: Any) -> bytes:
        """PNG bytes of the figure for the timeline's current data."""
        waiting = not timeline.steps
        stale = self._background is None or waiting != self._waiting.get_visible()
        self._waiting.set_visible(waiting)
        self._losses(timeline)
        self._scores(timeline)
        self._series(
            PANELS[2], "lr", timeline.steps, timeline.learning_rates, {"color": "tab:purple"}, legend=False
        )
        for key, values in timeline.memory.items():
            self._series(
                PANELS[3], _MEMORY_LABELS.get(key, key), timeline.memory_steps, [v / _MIB for v in values], {}
            )
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

    def _losses(self, timeline: Any) -> None:
        for i, name in enumerate(timeline.losses):
            color = f"C{i % 10}"
            self._series(
                PANELS[0],
                f"{name} raw",
                timeline.steps,
                timeline.losses[name],
                {"color": color, "lw": 0.7, "alpha": 0.35},
                legend=False,
            )
            self._series(
                PANELS[0], name, timeline.steps, timeline.smoothed[name], {"color": color, "lw": 1.5}
            )

    def _scores(self, timeline: Any) -> None:
        epochs = sorted(timeline.scores)
        keys = sorted({k for row in timeline.scores.values() for k in row if k != "learning_rate"})
        for i, key in enumerate(keys):
            style = {
                "color": f"C{i % 10}",
                "marker": "o",
                "ms": 3,
                "ls": "--" if key.startswith("train") else "-",
            }
            self._series(
                PANELS[1],
                key,
                epochs,
                [timeline.scores[e].get(key, math.nan) for e in epochs],
                style,
                thin=False,
            )

    def _series(
        self, panel: str, label: str, x: list, y: list, style: dict, *, legend: bool = True, thin: bool = True
    ) -> None:
        if thin and len(x) > self.max_points:
            k = math.ceil(len(x) / self.max_points)
            x, y = x[::k], y[::k]
        line = self._lines.get((panel, label))
        if line is None:
            (line,) = self.axes[panel].plot(
                x, y, label=label if legend else f"_{label}", animated=True, **style
            )
            self._lines[(panel, label)] = line
        else:
            line.set_data(x, y)

    def _update_legend(self, panel: str) -> bool:
        """Draw the legend if the panel's labels changed; True if it did."""
        ax = self.axes[panel]
        labels = tuple(line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_"))
        if not labels or labels == self._legend_keys.get(panel):
            return False
        # losses and scores fall, memory grows: keep the legend where the newest data is not
        loc = "lower right" if panel == PANELS[3] else "upper right"
        ax.legend(fontsize=6, loc=loc, ncol=1 + len(labels) // 5, framealpha=0.6)
        self._legend_keys[panel] = labels
        return True

    def _update_limits(self, panel: str, *, force: bool) -> bool:
        """New axis limits if the data left the old ones or fills too little of them; True if changed."""
        ax = self.axes[panel]
        bounds = _data_bounds(ax.get_lines())
        if bounds is None:
            return False
        x_lo, x_hi, y_lo, y_hi = bounds
        if panel == PANELS[1]:  # epochs: whole epochs, one either side
            target_x = (x_lo - 1, x_hi + 1)
        else:  # steps: room for half as many again before the next full draw
            target_x = (x_lo, x_hi + max(0.5 * (x_hi - x_lo), 1))
        pad = 0.1 * (y_hi - y_lo) or 0.05 * abs(y_hi) or 0.5
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
