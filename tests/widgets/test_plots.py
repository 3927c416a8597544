"""The dashboard picture: frames blit onto a kept background until the data outgrow the axes."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402

from kit.widgets.plots import PANELS, DashboardFigure  # noqa: E402


def timeline(n: int, *, scores: int = 0, loss=lambda g: 2.0 * math.exp(-g / 50) + 0.1):
    steps = list(range(n))
    ce = [loss(g) for g in steps]
    return SimpleNamespace(
        steps=steps,
        losses={"ce": ce},
        smoothed={"ce": ce},
        scores={e: {"train_loss_ce": 1.0 / e, "dev_loss_ce": 1.2 / e} for e in range(1, scores + 1)},
        learning_rates=[1e-3] * n,
        memory={"memory_rss": [(100 + 2 * (1 - math.exp(-g / 20))) * 2**20 for g in steps]},  # settles
        memory_steps=steps,
    )


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_frames_blit_while_the_data_fit_and_redraw_when_they_outgrow_the_axes() -> None:
    fig = DashboardFigure()
    first = fig.render(timeline(100))
    assert fig.num_full_draws == 1 and first.startswith(b"\x89PNG")
    limits = fig.axes[PANELS[0]].get_xlim()
    assert limits[1] >= 140  # room to grow before the next full draw

    grown = fig.render(timeline(130))  # still inside the limits: lines only
    assert fig.num_full_draws == 1 and fig.axes[PANELS[0]].get_xlim() == limits
    assert not np.array_equal(pixels(first), pixels(grown))  # the new steps are drawn

    fig.render(timeline(400))  # past the limits: axes, ticks and background drawn anew
    assert fig.num_full_draws == 2
    x_lo, x_hi = fig.axes[PANELS[0]].get_xlim()
    assert x_lo <= 0 and 399 <= x_hi


def test_a_blitted_frame_equals_a_full_draw_of_the_same_data() -> None:
    blitted, full = DashboardFigure(), DashboardFigure()
    blitted.render(timeline(100))
    frame = blitted.render(timeline(120))
    assert blitted.num_full_draws == 1
    full.render(timeline(100))  # same limits, then a forced full draw with the newer data
    full._background = None
    full._update_limits = lambda panel, force: False  # keep the limits the first frame chose
    reference = full.render(timeline(120))
    assert full.num_full_draws == 2
    assert np.array_equal(pixels(frame), pixels(reference))


def test_axes_shrink_back_when_the_data_fill_too_little_of_them() -> None:
    fig = DashboardFigure()
    fig.render(timeline(1000))
    fig.render(timeline(20))  # e.g. a new timeline after a restore
    x_lo, x_hi = fig.axes[PANELS[0]].get_xlim()
    assert x_hi < 100 and fig.num_full_draws == 2


def test_non_finite_losses_and_a_new_legend_entry() -> None:
    fig = DashboardFigure()
    fig.render(timeline(50, loss=lambda g: math.nan if g == 10 else 1.0 / (g + 1)))
    y_lo, y_hi = fig.axes[PANELS[0]].get_ylim()
    assert math.isfinite(y_lo) and math.isfinite(y_hi) and y_hi >= 1.0
    draws = fig.num_full_draws
    fig.render(timeline(50, scores=1))  # the scores panel gets its lines and legend
    assert fig.num_full_draws == draws + 1
    x_lo, x_hi = fig.axes[PANELS[1]].get_xlim()
    assert x_lo == 0 and x_hi == 2  # one epoch: whole epochs either side
