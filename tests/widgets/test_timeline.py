"""The dashboard's store: losses read at flush time, smoothing, thinning, ETA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kit.engine.accounting import StepLosses
from kit.widgets.timeline import Timeline


def step(g: int, losses: dict[str, float], *, epoch: int = 1, frac: float | None = None, lr: float = 0.1):
    names = list(losses)
    sums = [torch.tensor(losses[n] * 2, dtype=torch.float64) for n in names]  # sum / norm = value
    norms = [torch.tensor(2.0, dtype=torch.float64) for _ in names]
    return SimpleNamespace(
        epoch=epoch,
        step=g,
        global_train_step=g,
        learning_rate=lr,
        complete_frac=frac,
        step_losses=StepLosses(names, sums, norms),
        seconds=0.01,  # the history (the timeline's store) keeps these too
        num_seqs=4,
        memory_peak=None,
    )


def test_losses_are_read_at_flush_not_per_step() -> None:
    t = Timeline()
    t.add_step(step(0, {"ce": 1.0}))
    t.add_step(step(1, {"ce": 0.5}))
    assert t.steps == [] and t.num_steps == 2  # nothing read yet
    t.flush()
    assert t.steps == [0, 1]
    assert t.losses["ce"] == pytest.approx([1.0, 0.5])
    assert t.learning_rates == [0.1, 0.1]


def test_smoothing_is_bias_corrected_and_missing_losses_are_nan() -> None:
    t = Timeline(smoothing=0.5)
    t.add_step(step(0, {"ce": 4.0}))
    t.add_step(step(1, {"ce": 2.0, "fer": 0.5}))
    t.flush()
    assert t.smoothed["ce"][0] == pytest.approx(4.0)  # first point equals the raw value, not 0.5 * 4
    assert t.smoothed["ce"][1] == pytest.approx((0.25 * 4 + 0.5 * 2) / 0.75)
    assert math.isnan(t.losses["fer"][0]) and t.losses["fer"][1] == pytest.approx(0.5)
    assert t.latest_losses() == pytest.approx({"ce": (0.25 * 4 + 0.5 * 2) / 0.75, "fer": 0.5})


def test_thinning_keeps_memory_bounded_and_the_newest_point() -> None:
    t = Timeline(max_points=10)
    for g in range(40):
        t.add_step(step(g, {"ce": float(g)}))
        t.flush()
    assert len(t.steps) <= 10 and t.num_steps == 40
    assert t.steps == sorted(t.steps) and t.steps[-1] >= 32
    assert all(len(v) == len(t.steps) for v in (*t.losses.values(), *t.smoothed.values(), t.learning_rates))


def test_eta_from_complete_frac_and_wall_time() -> None:
    t = Timeline()
    for g in range(5):  # one step per second, 5 of 20 steps done
        t.add_step(step(g, {"ce": 1.0}, frac=(g + 1) / 20), now=100.0 + g)
    assert t.seconds_per_step() == pytest.approx(1.0)
    assert t.epoch_eta() == pytest.approx(15.0)
    t.new_run()  # a pause is not step time
    t.add_step(step(5, {"ce": 1.0}, frac=6 / 20), now=1000.0)
    assert t.seconds_per_step() is None and t.epoch_eta() is None


def test_scores_keep_numbers_and_skip_untrained_epochs() -> None:
    t = Timeline()
    t.add_scores(1, {"learning_rate": 0.1, "dev_loss_ce": 0.5, "note": "x"})
    t.add_scores(2, {"learning_rate": 0.1})
    assert t.scores == {1: {"learning_rate": 0.1, "dev_loss_ce": 0.5}}


def test_history_reads_cpu_losses_every_64_steps_and_memory_every_flush_every() -> None:
    from kit.engine.memory import MemoryFigures
    from kit.session import history as history_mod

    h = history_mod.History(flush_every=150)
    reads: list[int] = []
    h.memory_source = lambda: reads.append(len(h)) or MemoryFigures(rss=123)  # type: ignore[func-returns-value]
    read_at = []
    for g in range(300):
        before = len(h.rows)
        h.on_step_end(step(g, {"ce": float(g)}))  # type: ignore[arg-type]
        if len(h.rows) != before:
            read_at.append(len(h.rows))
    assert history_mod.CPU_FLUSH_EVERY == 64
    assert read_at == [64, 128, 150, 214, 278, 300]  # every 64 pending steps, and with each memory read
    assert reads == [150, 300]  # the memory figures: every flush_every steps, not at every read
    rows = h.rows
    assert [r["global_train_step"] for r in rows if "memory_rss" in r] == [149, 299]
    assert [r["ce"] for r in rows] == pytest.approx([float(g) for g in range(len(rows))])
