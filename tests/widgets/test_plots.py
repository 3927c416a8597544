"""The dashboard picture: frames blit onto a kept background until the data outgrow the axes."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402

from kit.widgets.plots import ERRORS, LOSSES, LR, MEMORY, PANELS, SCORE_ERRORS, SCORES, DashboardFigure  # noqa: E402


def timeline(n: int, *, scores: int = 0, loss=lambda g: 2.0 * math.exp(-g / 50) + 0.1, errors: bool = False):
    steps = list(range(n))
    ce = [loss(g) for g in steps]
    fer = [0.1 + 0.05 * math.exp(-g / 30) for g in steps]
    rows = {e: {"train_loss_ce": 1.0 / e, "dev_loss_ce": 1.2 / e} for e in range(1, scores + 1)}
    if errors:
        for e, row in rows.items():
            row.update(train_loss_fer=0.2 / e, dev_loss_fer=0.25 / e)
    return SimpleNamespace(
        steps=steps,
        losses={"ce": ce, **({"fer": fer} if errors else {})},
        smoothed={"ce": ce, **({"fer": fer} if errors else {})},
        error_names={"fer"} if errors else set(),
        scores=rows,
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
    assert 105 <= limits[1] <= 99 * 1.1 + 1  # a little room to grow before the next full draw, no more

    grown = fig.render(timeline(106))  # still inside the limits: lines only
    assert fig.num_full_draws == 1 and fig.axes[PANELS[0]].get_xlim() == limits
    assert not np.array_equal(pixels(first), pixels(grown))  # the new steps are drawn

    fig.render(timeline(400))  # past the limits: axes, ticks and background drawn anew
    assert fig.num_full_draws == 2
    x_lo, x_hi = fig.axes[PANELS[0]].get_xlim()
    assert x_lo <= 0 and 399 <= x_hi


def test_a_blitted_frame_equals_a_full_draw_of_the_same_data() -> None:
    blitted, full = DashboardFigure(), DashboardFigure()
    blitted.render(timeline(100))
    frame = blitted.render(timeline(106))
    assert blitted.num_full_draws == 1
    full.render(timeline(100))  # same limits, then a forced full draw with the newer data
    full._background = None
    full._update_limits = lambda panel, force: False  # keep the limits the first frame chose
    reference = full.render(timeline(106))
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
    x_lo, x_hi = fig.axes[SCORES].get_xlim()
    assert (x_lo, x_hi) == (0.75, 1.25)  # one epoch: a quarter epoch either side
    assert [t for t in fig.axes[SCORES].get_xticks() if x_lo <= t <= x_hi] == [1]  # whole epochs only


def test_losses_and_error_rates_on_their_own_axes_with_readable_legends_and_placeholders() -> None:
    fig = DashboardFigure()
    fig.render(timeline(0))
    assert fig.panels == (LOSSES, SCORES, MEMORY)  # nothing yet says there are error rates or a changing LR
    for panel in fig.panels:
        assert fig._placeholders[panel].get_visible()  # every panel says what will appear
    assert fig._placeholders[SCORES].get_text() == "scores appear after epoch 1"
    fig.render(timeline(80, scores=2, errors=True))
    assert fig.panels == (LOSSES, ERRORS, SCORES, SCORE_ERRORS, MEMORY)
    labels = {p: [ln.get_label() for ln in fig.axes[p].get_lines() if not ln.get_label().startswith("_")]
              for p in fig.panels}
    assert labels[LOSSES] == ["ce"] and labels[ERRORS] == ["fer"]
    assert set(labels[SCORES]) == {"train_loss_ce", "dev_loss_ce"}
    assert set(labels[SCORE_ERRORS]) == {"train_loss_fer", "dev_loss_fer"}
    assert not any(fig._placeholders[p].get_visible() for p in (LOSSES, ERRORS, SCORES, SCORE_ERRORS))
    y_lo, y_hi = fig.axes[ERRORS].get_ylim()
    assert 0.09 < y_lo and y_hi < 0.16  # fitted to the error rates alone, not to the 2.0 loss
    for panel in (LOSSES, ERRORS, SCORES, SCORE_ERRORS):
        assert all(t.get_fontsize() >= 9 for t in fig.axes[panel].get_legend().get_texts())


def test_panels_adapt_to_the_run_no_empty_frames() -> None:
    """No error rates: no error panels; a constant LR: a number in a title, not a flat line."""
    fig = DashboardFigure()
    fig.render(timeline(50, scores=1))
    assert fig.panels == (LOSSES, SCORES, MEMORY)
    assert sum(ax.get_visible() for ax in fig.figure.axes) == 3  # no empty frame drawn
    assert fig.axes[LOSSES].get_title().endswith("lr 0.001")
    changing = timeline(50, scores=1)
    changing.learning_rates = [1e-3 * (0.99**g) for g in range(50)]
    fig.render(changing)
    assert fig.panels == (LOSSES, LR, SCORES, MEMORY)
    assert fig.plotted(LR, "lr")[1] == pytest.approx(changing.learning_rates)
    assert "lr" not in fig.axes[LOSSES].get_title()
    assert fig.axes[LR].get_ylim()[0] <= min(changing.learning_rates)


def test_losses_spanning_orders_of_magnitude_get_a_log_axis() -> None:
    fig = DashboardFigure()
    fig.render(timeline(100, loss=lambda g: 0.9 ** g + 1e-3))  # 1.0 down to 1e-3
    assert fig.axes[LOSSES].get_yscale() == "log"
    y_lo, y_hi = fig.axes[LOSSES].get_ylim()
    assert 0 < y_lo < 1.1e-3 and y_hi > 1.0
    flat = DashboardFigure()
    flat.render(timeline(100))  # 2.1 down to ~0.24: a linear axis reads well
    assert flat.axes[LOSSES].get_yscale() == "linear"


def test_no_label_is_clipped() -> None:
    """Every tick label and title lies inside the figure (the memory axis's 4-digit MiB too)."""
    fig = DashboardFigure()
    big = timeline(200, scores=3, errors=True)
    big.memory = {"memory_rss": [(123_456 + g) * 2**20 for g in big.steps]}  # 6-digit MiB labels
    big.losses["ce"] = big.smoothed["ce"] = [0.00012345 + 1e-7 * g for g in big.steps]  # long tick labels
    fig.render(big)
    renderer = fig.figure.canvas.get_renderer()
    box = fig.figure.bbox
    drawn = {panel: ax.get_tightbbox(renderer) for panel, ax in fig.axes.items()}  # titles, tick labels, legend
    for panel, ext in drawn.items():
        assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1 and box.y0 - 1 <= ext.y0 and ext.y1 <= box.y1 + 1, panel
    for a in drawn:  # nor does one panel's labels run into another panel
        for b in drawn:
            if a < b:
                assert not drawn[a].overlaps(drawn[b]), (a, b)
