"""``session.plot()``: losses and error rates per step on separate axes, scores per epoch, fitted axes."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("matplotlib")

import kit  # noqa: E402
from kit.widgets.training_plot import PlotFigure, loss_columns, smooth  # noqa: E402
from tests.helpers.models import tiny_config  # noqa: E402


def _lines(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


def test_plot_after_training_separates_losses_and_error_rates_and_leaves_out_memory():
    with kit.Session(**tiny_config(num_epochs=2)) as s:
        s.train()
        history, scores = s.history, s.scores
        fig = s.plot()
    assert isinstance(fig, PlotFigure)
    (loss_steps, error_steps), (loss_epochs, error_epochs) = [fig.axes[:2], fig.axes[2:]]
    assert loss_steps.get_title() == "losses per step" and error_steps.get_title() == "error rates per step"
    assert "ce (smoothed)" in _lines(loss_steps) and "fer (smoothed)" in _lines(error_steps)
    assert "fer (smoothed)" not in _lines(loss_steps)
    assert any(c.startswith("memory_") for c in history.columns)  # recorded, but never drawn
    assert not any("memory" in label for ax in fig.axes for label in _lines(ax))
    assert set(loss_columns(history)) == {"ce", "fer"}
    # step axis fitted to the data (no run-off past the last step); y within the data plus small headroom
    assert loss_steps.get_xlim() == (0.0, float(history["global_train_step"].max()))
    lo, hi = loss_steps.get_ylim()
    assert history["ce"].min() - 0.2 * (hi - lo) <= lo and hi <= history["ce"].max() + 0.2 * (hi - lo)
    assert set(_lines(loss_epochs)) >= {"train_loss_ce", "dev_loss_ce"}
    assert set(_lines(error_epochs)) >= {"train_loss_fer", "dev_loss_fer"}
    assert loss_epochs.get_xlim() == (0.5, 2.5)
    y = _lines(loss_epochs)["dev_loss_ce"].get_ydata()
    assert list(y) == list(scores["dev_loss_ce"])
    for text in (t for ax in fig.axes for t in ax.get_legend().get_texts()):
        assert text.get_fontsize() >= 9
    assert fig._repr_png_().startswith(b"\x89PNG")


def test_plot_before_epoch_one_ends_says_when_scores_appear():
    with kit.Session(**tiny_config()) as s:
        fig = s.plot()  # nothing trained yet
        assert "no train step yet" in [t.get_text() for t in fig.axes[0].texts]
        s.train_steps(3)
        fig = s.plot()
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "scores appear after epoch 1" in texts
    buf = io.BytesIO()
    fig.savefig(buf, format="png")


def test_smooth_is_a_bias_corrected_moving_average_that_skips_nan():
    import numpy as np

    out = smooth(np.array([1.0, np.nan, 3.0]), 0.5)
    assert out[0] == 1.0 and out[1] == 1.0 and out[2] == pytest.approx((0.25 + 1.5) / 0.75)
