"""The dashboard's picture: one matplotlib figure (Agg, no pyplot) rendered to PNG bytes.

The figure and its lines are made once and updated with new data, so a redraw costs one
Agg draw plus PNG encoding. Long series are drawn with at most ``max_points`` points.
"""

from __future__ import annotations

import io
import math
from typing import Any

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
        self._waiting.set_visible(not timeline.steps)
        self._losses(timeline)
        self._scores(timeline)
        self._series(
            PANELS[2], "lr", timeline.steps, timeline.learning_rates, {"color": "tab:purple"}, legend=False
        )
        for key, values in timeline.memory.items():
            self._series(
                PANELS[3], _MEMORY_LABELS.get(key, key), timeline.memory_steps, [v / _MIB for v in values], {}
            )
        for panel in PANELS:
            self._rescale(panel)
        if len(timeline.scores) == 1:  # one epoch: keep the axis at whole epochs
            (epoch,) = timeline.scores
            self.axes[PANELS[1]].set_xlim(epoch - 1, epoch + 1, auto=True)
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png")
        return buf.getvalue()

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
            (line,) = self.axes[panel].plot(x, y, label=label if legend else f"_{label}", **style)
            self._lines[(panel, label)] = line
        else:
            line.set_data(x, y)

    def _rescale(self, panel: str) -> None:
        ax = self.axes[panel]
        ax.relim()
        ax.autoscale_view()
        labels = tuple(line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_"))
        if labels and labels != self._legend_keys.get(panel):
            # losses and scores fall, memory grows: keep the legend where the newest data is not
            loc = "lower right" if panel == PANELS[3] else "upper right"
            ax.legend(fontsize=6, loc=loc, ncol=1 + len(labels) // 5, framealpha=0.6)
            self._legend_keys[panel] = labels
