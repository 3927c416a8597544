"""The dashboard follows every run of its session (notebook 02's sequence): every panel, every step.

Blocking, awaited, background, ``live=True`` and after ``extend``: after each run the picture's lines
hold exactly the session's history (losses, learning rate) and score table, and the static image
the notebook keeps is the last frame — also when runs come back to back (Run All), where the last
frame is drawn shortly after the run instead of within it.
"""

from __future__ import annotations

import asyncio
import base64
import time

import pytest
from helpers.models import tiny_config

import kit
from kit.widgets import Dashboard
from kit.widgets.plots import LOSSES, LR, SCORE_ERRORS, SCORES

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")


class Handle:
    def __init__(self) -> None:
        self.bundles: list[dict] = []

    def update(self, obj: dict, **_: object) -> None:
        self.bundles.append(obj)


def wait_for_last_frame(dash: Dashboard) -> None:
    deadline = time.monotonic() + 5.0
    while "kit-dashboard-final" not in dash.widget._dom_classes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "kit-dashboard-final" in dash.widget._dom_classes, "no last frame after the run"


def check_pictures_the_session(dash: Dashboard, session: kit.Session, handle: Handle) -> None:
    wait_for_last_frame(dash)
    history, scores = session.history, session.scores
    figure = dash._figure
    steps, ce = figure.plotted(LOSSES, "ce raw")
    assert steps == [float(g) for g in history["global_train_step"]]  # every step so far, none twice
    assert ce == pytest.approx(list(history["ce"]), rel=1e-6)
    assert figure.plotted(LR, "lr")[1] == pytest.approx(list(history["learning_rate"]))
    trained = scores.dropna(subset=["train_loss_ce"])
    for key, panel in (("dev_loss_ce", SCORES), ("dev_loss_fer", SCORE_ERRORS)):
        epochs, values = figure.plotted(panel, key)
        assert epochs == [float(e) for e in trained.index]  # every epoch so far
        assert values == pytest.approx(list(trained[key]), rel=1e-6)
    last = handle.bundles[-1]  # what the saved notebook shows: the last frame, and the position reached
    assert base64.b64decode(last["image/png"]) == bytes(dash.image.value)
    p = session.progress
    assert f"step {history['step'].iloc[-1] + 1}" in last["text/plain"]
    assert f"{len(history)} steps watched" in last["text/plain"] and p.global_train_step == len(history)


def test_the_dashboard_follows_notebook_02s_sequence(tmp_path, monkeypatch) -> None:
    import IPython.display

    shown: list[object] = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    lrs = [0.01, 0.008, 0.006, 0.005, 0.004]  # a changing learning rate: its panel is drawn
    session = kit.Session(tiny_config(model=str(tmp_path / "model"), num_epochs=2, learning_rates=lrs))
    dash = Dashboard(session, mode="widget")
    handle = Handle()
    dash._displays.append(handle)  # as when shown in a cell (display id)

    async def cell_4_and_6() -> None:
        first = await session.train_async()
        assert first.outcome == "finished"  # trained to the final epoch
        check_pictures_the_session(dash, session, handle)
        again = await session.train_async()  # every epoch trained: says so, runs nothing
        assert again.outcome == "finished" and "nothing left to train" in again.summary()

    asyncio.run(cell_4_and_6())
    check_pictures_the_session(dash, session, handle)

    session.extend(3)
    session.train_in_background("epoch")
    assert session.wait(timeout=120).outcome == "done"
    check_pictures_the_session(dash, session, handle)

    session.extend(4)
    session.train_epoch(live=True)  # a second dashboard in this cell; the first one follows too
    check_pictures_the_session(dash, session, handle)
    assert any(isinstance(d, Dashboard) and d is not dash for d in shown)

    session.extend(5)
    session.train_steps(3)  # back to back with the call before: a loop of short calls
    session.train_steps(2)
    check_pictures_the_session(dash, session, handle)
    assert list(session.scores.dropna(subset=["train_loss_ce"]).index) == [1, 2, 3, 4]
    assert sorted(set(dash._figure.plotted(LR, "lr")[1]), reverse=True) == pytest.approx(lrs)  # epochs 1-5
