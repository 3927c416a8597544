"""The default progress of ``session.train*()`` in a notebook: one line updated in place, throttled."""

from __future__ import annotations

import itertools
import logging

import pytest

pytest.importorskip("IPython")

import kit  # noqa: E402
import kit.widgets.dashboard  # noqa: E402
from kit.widgets.progress import ProgressLine  # noqa: E402
from tests.helpers.models import tiny_config  # noqa: E402


class Handle:
    def __init__(self, shown: list) -> None:
        self.bundles: list[dict] = []
        shown.append(self)

    def update(self, bundle: dict, raw: bool = False) -> None:
        self.bundles.append(bundle)


@pytest.fixture
def shown(monkeypatch) -> list[Handle]:
    """A notebook: default_mode() says "widget", display() records the handles it returns."""
    handles: list[Handle] = []

    def display(bundle, raw=False, display_id=None):
        handle = Handle(handles)
        handle.bundles.append(bundle)
        return handle

    monkeypatch.setattr(kit.widgets.dashboard, "default_mode", lambda: "widget")
    monkeypatch.setattr("IPython.display.display", display)
    ticks = itertools.count()
    monkeypatch.setattr(ProgressLine, "clock", staticmethod(lambda: next(ticks) * 0.1))  # 0.1 s per read
    return handles


def test_train_epoch_shows_one_line_updated_in_place_and_throttled(shown):
    with kit.Session(**tiny_config()) as s:
        s.train_epoch()
        steps = s.progress.global_train_step
    assert len(shown) == 1
    texts = [b["text/plain"] for b in shown[0].bundles]
    assert 2 <= len(texts) < steps / 2  # every 0.5 s of the fake clock, not every step
    assert texts[1].startswith("epoch 1/3 · step ") and " ce " in texts[1] and "lr 0.01" in texts[1]
    assert texts[-1].startswith("epoch 1/3") and "done" in texts[-1] and "epoch 1: train_loss_ce" in texts[-1]
    assert "kit-progress" in shown[0].bundles[-1]["text/html"]


def test_each_call_gets_its_own_line_and_a_single_step_none(shown):
    with kit.Session(**tiny_config()) as s:
        s.train_step()
        assert not shown
        s.train_steps(3)
        s.train_steps(2)
    assert len(shown) == 2 and "step 6" in shown[1].bundles[-1]["text/plain"]


def test_live_false_or_an_open_dashboard_or_text_mode_show_nothing(shown, monkeypatch):
    with kit.Session(**tiny_config(), live=False) as s:
        s.train_steps(3)
    with kit.Session(**tiny_config()) as s:
        s.train_steps(2)
        assert len(shown) == 1
        dashboard = s.dashboard()
        s.train_steps(2)
        assert len(shown) == 1  # the dashboard shows the progress
        dashboard.detach()
        s.train_steps(2)
        assert len(shown) == 2
    monkeypatch.setattr(kit.widgets.dashboard, "default_mode", lambda: "text")  # nbval
    with kit.Session(**tiny_config()) as s:
        s.train_steps(3)
    assert len(shown) == 2


def test_a_pause_ends_the_line_and_is_no_warning(shown, caplog):
    with kit.Session(**tiny_config()) as s:
        s.on("step_end", lambda result, **_: result.step == 2 and s.pause())
        with caplog.at_level(logging.INFO, logger="kit"):
            paused = s.train_epoch()
    assert isinstance(paused, kit.Paused)
    assert "paused at epoch 1, step 3" in shown[0].bundles[-1]["text/plain"]
    records = [r for r in caplog.records if "paused at" in r.getMessage()]
    assert records and all(r.levelno < logging.WARNING for r in records)  # never a stderr warning box


def test_an_error_ends_the_line_with_it(shown):
    def bad_step(**kwargs):
        raise ValueError("broken on purpose")

    with kit.Session(**tiny_config(train_step=bad_step)) as s:
        s.debug_hook = None
        with pytest.raises(ValueError):
            s.train_epoch()
    assert "ValueError in train: broken on purpose" in shown[0].bundles[-1]["text/plain"]
