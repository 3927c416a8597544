"""Dashboard widget model without a browser: state after events, throttling, bundle, detach, Pause."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import subprocess
import sys
import time

import ipywidgets
import pytest
import torch
from helpers.models import params_equal, tiny_config

import kit
from kit.engine.accounting import StepLosses
from kit.engine.step import StepResult
from kit.events import StepEnd
from kit.widgets import Dashboard
from kit.widgets.dashboard import WIDGET_VIEW_MIME, default_mode
from kit.widgets.plots import DashboardFigure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    def __init__(self, t: float = 0.0, tick: float = 0.0):
        self.t, self.tick = t, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def fake_step(g: int, ce: float = 1.0, *, frac: float | None = None) -> StepResult:
    losses = StepLosses(
        ["ce"], [torch.tensor(ce, dtype=torch.float64)], [torch.tensor(1.0, dtype=torch.float64)]
    )
    return StepResult(1, g, g, 0.01, True, 0.001, 4, frac, losses)


def dashboard_handlers(session: kit.Session, event: str) -> list:
    return [fn for fn in session._parts.events.handlers(event) if fn.__qualname__.startswith("Dashboard.")]


def test_import_kit_loads_no_widget_libraries() -> None:
    code = (
        "import sys, kit, kit.widgets; from kit.widgets import Dashboard, CheckpointWidget; "
        "bad = [m for m in ('ipywidgets', 'matplotlib', 'pandas') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_state_after_steps_and_epoch_end() -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")
    assert isinstance(dash.widget, ipywidgets.VBox)
    assert "no training step yet" in dash.progress_line.value
    session.train_steps(3)
    dash.refresh(plot=True)
    assert dash.timeline.steps == [0, 1, 2]
    history = session.history
    for name in ("ce", "fer"):  # the same values as the session's history, read by the dashboard itself
        assert dash.timeline.losses[name] == pytest.approx(list(history[name]), rel=1e-12)
    progress = dash.progress_line.value
    assert "epoch 1/3" in progress and "step 3 of ≈" in progress and "%" in progress and "s/step" in progress
    assert "status: ready" in dash.status_line.value
    assert re.search(r"process RSS [0-9.]+ [MG]iB", dash.memory_line.value)  # (GiB late in a long test run)
    assert bytes(dash.image.value).startswith(PNG_MAGIC)
    assert dash.timeline.memory["memory_rss"][-1] > 0

    session.train_epoch()
    dash.refresh(plot=True)
    expected = {k: v for k, v in session.info().score_table.scores(1).items()}
    assert dash.timeline.scores[1] == pytest.approx({**expected, "learning_rate": 0.01})
    assert "epoch 1: train_loss_ce" in dash.summary()


def test_redraws_are_throttled_by_wall_time(monkeypatch) -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget", max_redraws_per_sec=2.0, plot_budget=0.02, plot_burst=0.1)
    dash.clock = clock = FakeClock()
    renders = []

    def render(self, timeline):
        clock.t += 0.05  # each picture costs 50 ms
        renders.append((clock.t, len(timeline.steps)))
        return PNG_MAGIC + bytes([len(renders) % 256])

    monkeypatch.setattr(DashboardFigure, "render", render)
    images = []
    dash.image.observe(lambda change: images.append(change["new"]), names="value")
    for g in range(1000):  # one step every 100 ms for 100 s
        clock.t = g * 0.1
        session._parts.events.emit(StepEnd(fake_step(g)))
    assert dash.num_refreshes == 200  # text: at most twice per second
    times = [t for t, _ in renders]
    assert all(b - a >= 0.5 for a, b in zip(times, times[1:]))  # the picture too
    assert sum(1 for t in times if t < 3.0) >= 3  # quick feedback at the start (the burst)
    drawing = 0.05 * (len(renders) - 1)  # the first picture (font loading) is not counted
    assert drawing <= 0.02 * 100 + 0.1  # in the long run at most 2 % of the time
    assert drawing >= 0.02 * 100 - 0.1  # and it uses its budget: the picture stays live
    assert len(images) == dash.num_plots == len(renders)  # one image, replaced in place
    assert len(dash.widget.children) == 6  # buttons+status, progress, ranks strip, note, image, memory
    assert renders[-1][1] > 950  # late frames show the late steps


def test_a_new_run_gets_a_frame_soon_after_earlier_runs_spent_the_budget(monkeypatch) -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget", plot_budget=0.005, plot_burst=0.1)
    dash.clock = clock = FakeClock()
    renders = []

    def render(self, timeline):
        clock.t += 0.07  # a full redraw
        renders.append(clock.t)
        return PNG_MAGIC

    monkeypatch.setattr(DashboardFigure, "render", render)
    for g in range(100):  # a first run of 10 s spends its burst: tokens are in deficit
        clock.t = g * 0.1
        session._parts.events.emit(StepEnd(fake_step(g)))
    dash._finish_run()  # e.g. paused; its last frame costs more
    assert dash._plot_tokens < 0
    clock.t += 1.0  # the user continues a second later
    start, before = clock.t, len(renders)
    for g in range(100, 120):  # the next run's first 2 s
        clock.t = start + (g - 100) * 0.1
        session._parts.events.emit(StepEnd(fake_step(g)))
    assert [t for t in renders[before:] if t < start + 1.0]  # a new frame within its first second


def test_mimebundle_has_widget_view_static_png_and_short_text() -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")
    session.train_steps(2)
    bundle = dash._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "image/png", WIDGET_VIEW_MIME}
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == dash.widget.model_id
    assert base64.b64decode(bundle["image/png"]).startswith(PNG_MAGIC)
    text = bundle["text/plain"]
    assert text.startswith("kit dashboard: ready; epoch 1/3, step 2") and len(text.splitlines()) <= 4
    assert "s/step" not in text and "ETA" not in text  # no timings: deterministic

    text_dash = Dashboard(session, mode="text")
    assert set(text_dash._repr_mimebundle_()) == {"text/plain"}
    assert text_dash.widget is None


def test_text_summary_is_deterministic() -> None:
    summaries = []
    for _ in range(2):
        session = kit.Session(tiny_config())
        dash = Dashboard(session, mode="text")
        session.train_epoch()
        summaries.append(dash.summary())
    assert summaries[0] == summaries[1]
    assert f"{len(session.history)} steps watched" in summaries[0]


@pytest.mark.parametrize("broken", [False, True])
def test_training_is_unchanged_by_a_dashboard_even_a_broken_one(monkeypatch, caplog, broken: bool) -> None:
    if broken:
        monkeypatch.setattr(DashboardFigure, "render", lambda self, timeline: 1 / 0)
    plain = kit.Session(tiny_config())
    plain.train_steps(5)
    watched = kit.Session(tiny_config())
    dash = Dashboard(watched, mode="widget", max_redraws_per_sec=1e6)
    with caplog.at_level(logging.WARNING, logger="kit"):
        watched.train_steps(5)
    assert params_equal(plain.model, watched.model)
    warnings = [r for r in caplog.records if "dashboard raised" in r.getMessage()]
    if broken:
        assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0].getMessage()
        assert dash.detached and dash.error.startswith("ZeroDivisionError")
        assert not any(dashboard_handlers(watched, e) for e in ("step_end", "epoch_end", "interrupt"))
        assert "detached" in dash.status_line.value
        assert dash.timeline.num_steps == 1  # it stopped watching at the first redraw
    else:
        assert not warnings and not dash.detached and dash.timeline.num_steps == 5


def test_pause_button_stops_at_the_next_step_and_the_next_call_continues() -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")

    def click_during_step_3(result, **_):  # as a click handled while the loop awaits
        if result.global_train_step == 2:
            dash.pause_button.click()
            assert dash.pause_button.disabled and "Pausing" in dash.pause_button.description

    session.on("step_end", click_during_step_3)
    paused = session.train_epoch()
    assert paused.paused and (paused.epoch, paused.step) == (1, 3)
    assert session.status == "paused"
    assert dash.status_text().startswith("paused at epoch 1, step 3")
    assert "status: paused at epoch 1, step 3" in dash.status_line.value
    assert "kit-dashboard-final" in dash.widget._dom_classes  # the last frame is drawn
    assert not dash.pause_button.disabled and dash.pause_button.description == "Pause"
    session.off("step_end", click_during_step_3)
    row = session.train_epoch()
    assert session.status == "ready" and "train_loss_ce" in row
    assert dash.timeline.num_steps == len(session.history)


def test_pause_click_when_nothing_runs_is_a_no_op() -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")
    dash.pause_button.click()
    assert "Nothing to pause" in dash.note.value
    result = session.train_steps(2)
    assert not getattr(result, "paused", False) and session.progress.global_train_step == 2


def test_pause_in_background_mode() -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")
    session.on("step_end", lambda result, **_: result.global_train_step == 1 and dash.pause_button.click())
    session.train_in_background("epoch")
    paused = session.wait(timeout=120)
    assert paused.paused and paused.step == 2
    assert dash.reach == "background" and session.status == "paused"
    assert dash.status_text().startswith("paused at epoch 1, step 2")


def test_resume_continues_a_background_run_in_the_background() -> None:
    session = kit.Session(tiny_config(num_epochs=1))
    dash = Dashboard(session, mode="widget")
    assert dash.resume_button.disabled  # nothing paused yet
    pause_at_1 = session.on("step_end", lambda result, **_: result.global_train_step == 1 and dash.pause_button.click())
    session.train_in_background("epoch")
    paused = session.wait(timeout=120)
    assert (paused.goal, paused.mode) == ("epoch", "background")
    dash.refresh()
    assert not dash.resume_button.disabled and dash.note.value == ""
    session.off("step_end", pause_at_1)
    dash.resume_button.click()
    assert dash.resume_button.disabled and "Resumed (background)" in dash.note.value
    row = session.wait(timeout=120)
    assert "train_loss_ce" in row and session.progress.epoch == 2  # the epoch the paused call was training, finished
    assert dash.timeline.num_steps == len(session.history)


def test_resume_continues_an_awaitable_run_on_the_event_loop() -> None:
    session = kit.Session(tiny_config(num_epochs=2))
    steps = {}

    async def cell() -> None:
        dash = Dashboard(session, mode="widget")
        pause = session.on("step_end", lambda result, **_: result.global_train_step == 3 and dash.pause_button.click())
        session._driver.yield_every_secs = 0.0
        paused = await session.train_steps_async(10)
        assert (paused.goal, paused.steps_left, paused.mode) == ("steps", 6, "awaitable")
        session.off("step_end", pause)
        dash.refresh()
        assert not dash.resume_button.disabled
        dash.resume_button.click()  # a click while the kernel's loop runs
        last = await dash.resume_task
        steps.update(last=last.last_step.global_train_step, total=session.progress.global_train_step)

    asyncio.run(cell())
    assert steps == {"last": 9, "total": 10}  # the paused train_steps(10) did all its 10 steps


def test_resume_is_disabled_after_a_blocking_call_and_says_why() -> None:
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")
    session.on("step_end", lambda result, **_: result.global_train_step == 1 and session.pause())
    paused = session.train_epoch()
    assert paused.mode == "blocking"
    assert dash.resume_button.disabled and "blocking train_* call" in dash.note.value
    assert "blocking" in dash.resume_button.tooltip
    dash.resume_button.disabled = False  # even forced, it does not start anything
    dash.resume_button.click()
    assert session.status == "paused" and "blocking" in dash.note.value


def test_says_when_pause_cannot_reach_a_blocking_call() -> None:
    session = kit.Session(tiny_config())
    seen = {}

    def look_during_step_4(dash):  # what the dashboard shows while the call still runs
        def handler(result, **_):
            if result.global_train_step % 4 == 3:
                dash.refresh()
                seen.update(reach=dash.reach, note=dash.note.value, disabled=dash.pause_button.disabled)

        return handler

    async def blocking():  # a plain train_* call in a cell: the kernel's loop never runs meanwhile
        dash = Dashboard(session, mode="widget")
        dash.clock = FakeClock(tick=0.4)
        session.on("step_end", look_during_step_4(dash))
        session.train_steps(4)

    asyncio.run(blocking())
    assert seen["reach"] == "blocking" and seen["disabled"]
    assert "cannot reach" in seen["note"] and "train_epoch_async" in seen["note"]

    async def awaiting():
        dash = Dashboard(session, mode="widget")
        session.on("step_end", look_during_step_4(dash))
        session._driver.yield_every_secs = 0.0
        await session.train_steps_async(4)

    seen.clear()
    asyncio.run(awaiting())
    assert seen["reach"] == "responsive" and not seen["disabled"]
    assert "Pause stops training at the next step boundary" in seen["note"]

    async def awaiting_with_slow_steps():  # a slow step after a fast one in the same time slice
        dash = Dashboard(session, mode="widget")
        session.on("step_end", look_during_step_4(dash))
        session.on("step_begin", lambda step, **_: step % 2 and time.sleep(0.25))  # odd steps are slow
        session._driver.yield_every_secs = 0.05
        await session.train_steps_async(4)

    seen.clear()
    asyncio.run(awaiting_with_slow_steps())
    assert seen["reach"] == "responsive" and not seen["disabled"]


def test_display_keeps_the_last_frame_as_static_image(monkeypatch) -> None:
    import IPython.display

    shown = []

    class Handle:
        def update(self, obj, **kwargs):
            shown.append(obj)

    def display(obj, **kwargs):
        shown.append(obj)
        return Handle()

    monkeypatch.setattr(IPython.display, "display", display)
    session = kit.Session(tiny_config())
    dash = Dashboard(session, mode="widget")
    dash._ipython_display_()
    assert set(shown[0]) == {"text/plain", "image/png", WIDGET_VIEW_MIME}
    session.on("step_end", lambda result, **_: result.global_train_step == 3 and session.pause())
    session.train_epoch()
    assert len(shown) == 2  # the output was updated when the run ended, not appended to
    assert base64.b64decode(shown[1]["image/png"]) == bytes(dash.image.value)
    assert shown[1]["text/plain"].startswith("kit dashboard: paused; epoch 1/3, step 4")


def test_session_live_shows_one_dashboard_per_call_each_keeping_its_own_last_frame(monkeypatch) -> None:
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    session = kit.Session(tiny_config(), live=True)
    session.train_steps(1)
    first_summary = shown[0].summary()
    session.train_steps(1)
    assert len(shown) == 2 and all(isinstance(d, Dashboard) for d in shown)
    assert shown[0] is not shown[1] and shown[0].detached and not shown[1].detached
    assert shown[0].summary() == first_summary  # the first cell's dashboard stays at its own run's end
    assert "step 2" in shown[1].summary()
    assert len(dashboard_handlers(session, "step_end")) == 1
    assert isinstance(session.dashboard(), Dashboard)


def test_terminal_mode_prints_a_bar_and_log_lines(capsys) -> None:
    session = kit.Session(tiny_config())
    Dashboard(session, mode="terminal", max_redraws_per_sec=1e6)
    session.train_epoch()
    err = capsys.readouterr().err
    assert "epoch 1/3" in err and "100%" in err
    assert "epoch 1: train_loss_ce" in err


def test_a_dashboard_made_later_shows_what_was_trained_before() -> None:
    session = kit.Session(tiny_config())
    session.train_epoch()
    session.train_steps(2)
    dash = Dashboard(session, mode="text")
    assert dash.timeline.num_steps == len(session.history)
    assert dash.timeline.steps == list(session.history["global_train_step"])
    assert list(dash.timeline.scores) == [1]
    assert "epoch 2/3, step 2" in dash.summary()


def test_default_mode(monkeypatch) -> None:
    monkeypatch.setenv("KIT_WIDGETS_TEXT", "1")
    assert default_mode() == "text"
    monkeypatch.setenv("KIT_WIDGETS_TEXT", "0")
    assert default_mode() == "terminal"  # not in a kernel
    monkeypatch.delenv("KIT_WIDGETS_TEXT")
    monkeypatch.setenv("KIT_TEST", "1")
    assert default_mode() == "text"
    with pytest.raises(ValueError, match="mode must be one of"):
        Dashboard(kit.Session(tiny_config()), mode="html")


def test_last_frame_is_drawn_when_the_training_cell_ends() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    saved = sys.displayhook, sys.excepthook
    shell = InteractiveShell.instance()
    try:
        session = kit.Session(tiny_config())
        dash = Dashboard(session, mode="widget", max_redraws_per_sec=1e-3)  # no redraw during the run
        shell.user_ns["session"] = session
        shell.run_cell("session.train_steps(3)", store_history=False)
        assert "kit-dashboard-final" in dash.widget._dom_classes
        assert dash.timeline.steps == [0, 1, 2] and "step 3" in dash.progress_line.value
        # the run_end event drew it: the dashboard hooks nothing into IPython
        assert not any("Dashboard" in getattr(f, "__qualname__", "") for f in shell.events.callbacks["post_run_cell"])
    finally:
        InteractiveShell.clear_instance()
        sys.displayhook, sys.excepthook = saved


class FakeCuda:
    """CUDA's allocator counters, faked: each step allocates 1 MiB more and peaks 5 MiB above that."""

    def __init__(self, monkeypatch) -> None:
        self.allocated, self.peak, self.resets = 0, 0, 0
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 64 * 2**20)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.max_allocated)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def max_allocated(self, device=None) -> int:
        self.allocated += 2**20  # read by the engine only (each step end, the epoch end): views never read it
        self.peak = max(self.peak, self.allocated + 5 * 2**20 * (1 + self.allocated // 2**20 % 3))
        return self.peak

    def reset(self, device=None) -> None:
        self.resets += 1
        self.peak = 0


def run_with_fake_cuda(monkeypatch, *, watched: bool) -> tuple[int, list[int], int]:
    """(the score table's peak_memory_bytes, the history's memory_peak column, counter resets)."""
    from kit.engine.memory import MemoryMeter

    cuda = FakeCuda(monkeypatch)
    session = kit.Session(tiny_config(num_epochs=1))
    session.setup()  # on the CPU; then the engine's meter reads the (fake) CUDA counters
    session._parts.engine._built.memory = MemoryMeter(torch.device("cuda", 0))  # the test swaps a private part
    dash = Dashboard(session, mode="widget", max_redraws_per_sec=1e6) if watched else None
    session.train()
    if dash is not None:
        assert dash.num_refreshes > 5 and "step peak" in dash.memory_text()  # it watched, and read memory
    history = session.history
    return session.info().score_table.meta(1)["peak_memory_bytes"], list(history["memory_peak"]), cuda.resets


def test_memory_peaks_are_the_engines_the_same_with_and_without_a_dashboard(monkeypatch) -> None:
    """Per-step CUDA peaks are measured by the engine alone: a dashboard reads figures, never resets them."""
    plain = run_with_fake_cuda(monkeypatch, watched=False)
    watched = run_with_fake_cuda(monkeypatch, watched=True)
    assert watched == plain
    peak, column, resets = plain
    assert len(column) == resets and len(set(column)) > 1  # a peak per step, and they differ
    assert peak >= max(column)  # the run's peak: every step's, and what eval allocated after the last reset


def test_without_ipywidgets_a_text_bar_instead(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets -> ImportError
    with caplog.at_level(logging.WARNING, logger="kit"):
        dash = Dashboard(kit.Session(tiny_config()), mode="widget")
    assert dash.mode == "terminal" and dash.widget is None
    assert "pip install ipywidgets" in caplog.text
    assert set(dash._repr_mimebundle_()) == {"text/plain"}
