"""The engine calls the optimizer through its public API: ``step()`` and ``zero_grad()``.

Whatever a user or torch attaches to those calls — a step hook, an LR scheduler's patched ``step``,
the profiler's ranges — runs on every update, exactly as in a hand-written loop.
"""

from __future__ import annotations

import torch
from helpers.models import TinyModel, tiny_config
from torch.optim.optimizer import register_optimizer_step_post_hook

import kit
from kit.engine.engine import Engine


def _engine(**keys: object) -> Engine:
    return Engine(kit.Config(tiny_config(None, get_model=lambda **_: TinyModel(dropout=0.0), **keys)))


def test_a_users_hook_on_the_optimizer_runs_every_update():
    engine = _engine()
    assert engine.train_step() is not None
    seen: list[int] = []
    assert engine.optimizer is not None
    engine.optimizer.register_step_post_hook(lambda opt, a, k: seen.append(len(opt.state)))
    for _ in range(3):
        assert engine.train_step() is not None
    assert len(seen) == 3 and all(seen)  # after each of the 3 updates, with the optimizer's state made


def test_a_global_step_hook_runs_every_update():
    calls: list[str] = []
    handle = register_optimizer_step_post_hook(lambda opt, a, k: calls.append(type(opt).__name__))
    try:
        engine = _engine()
        for _ in range(2):
            assert engine.train_step() is not None
    finally:
        handle.remove()
    assert calls == ["Adam", "Adam"]


def test_a_step_patched_onto_the_optimizer_is_called():
    engine = _engine()
    assert engine.train_step() is not None
    assert engine.optimizer is not None
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1)  # wraps opt.step to count its calls
    assert "step" in vars(engine.optimizer)
    assert engine.train_step() is not None
    assert engine.optimizer._opt_called  # type: ignore[attr-defined]  # the instance's step ran
    sched.step()


def test_under_a_recording_profiler_the_optimizers_ranges_show():
    engine = _engine()
    assert engine.train_step() is not None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert engine.train_step() is not None
    names = {e.name for e in prof.events()}
    assert any(n.startswith("Optimizer.step#") for n in names)
    assert any(n.startswith("Optimizer.zero_grad#") for n in names)
