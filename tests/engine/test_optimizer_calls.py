"""optimizer_calls: the optimizer's step and zero_grad without torch's profiler range, where nothing can tell."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from kit.engine import optimizer_calls


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()


@pytest.fixture
def ranges(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the profiler ranges torch's wrappers open (they look record_function up per call)."""
    opened: list[str] = []
    real = torch.autograd.profiler.record_function

    def counting(name: str, *args: object) -> object:
        opened.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counting)
    return opened


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2),
])
def test_the_same_updates_as_the_optimizers_own_step_without_its_range(make, ranges):
    mine, theirs = _model(), _model()
    opt_mine, opt_theirs = make(mine.parameters()), make(theirs.parameters())
    for seed in range(4):
        for model in (mine, theirs):
            _backward(model, seed)
        optimizer_calls.step(opt_mine)
        assert ranges == []  # kit's call opened no range
        opt_theirs.step()
        assert len(ranges) == 1 and ranges.pop().startswith("Optimizer.step#")
        optimizer_calls.zero_grad(opt_mine)
        opt_theirs.zero_grad()
        ranges.clear()
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters()))
    assert all(p.grad is None for p in mine.parameters())
    assert str(opt_mine.state_dict()) == str(opt_theirs.state_dict())


def test_step_hooks_of_the_optimizer_and_global_ones_are_called_through_torchs_step(ranges):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    calls: list[str] = []
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
    ]
    _backward(model, 0)
    optimizer_calls.step(opt)
    assert calls == ["pre", "post"] and len(ranges) == 1
    for h in handles:
        h.remove()
    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("global"))
    try:
        optimizer_calls.step(opt)
    finally:
        handle.remove()
    assert calls == ["pre", "post", "global"]
    optimizer_calls.step(opt)  # no hook left: kit's own call again
    assert calls == ["pre", "post", "global"] and len(ranges) == 2


def test_a_step_patched_onto_the_instance_is_called(ranges):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step to count its calls
    assert "step" in vars(opt)
    _backward(model, 0)
    before = copy.deepcopy(model.state_dict())
    optimizer_calls.step(opt)
    sched.step()  # no "lr_scheduler.step() before optimizer.step()" warning: the instance's step counted
    assert opt._opt_called  # type: ignore[attr-defined]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_under_a_recording_profiler_both_ranges_show_in_the_trace():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _backward(model, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer_calls.step(opt)
        optimizer_calls.zero_grad(opt)
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#AdamW.step" in names and "Optimizer.zero_grad#AdamW.zero_grad" in names
    assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_with_a_step_of_its_own_making_is_called_as_is():
    calls: list[str] = []

    class NotTorchs:  # duck-typed: no torch wrapper around its step
        param_groups: list = []

        def step(self) -> None:
            calls.append("step")

    assert optimizer_calls.unwrapped_step(NotTorchs) is None
    assert optimizer_calls.has_step_hooks(NotTorchs())  # type: ignore[arg-type]  # hooks unknown: torch's path
    optimizer_calls.step(NotTorchs())  # type: ignore[arg-type]
    assert calls == ["step"]


def test_the_engine_steps_through_it_and_a_users_hook_on_its_optimizer_runs_every_update(ranges):
    from helpers.models import TinyModel, tiny_config

    import kit
    from kit.engine.engine import Engine

    engine = Engine(kit.Config(tiny_config(None, get_model=lambda **_: TinyModel(dropout=0.0))))
    for _ in range(2):
        assert engine.train_step() is not None
    assert not [r for r in ranges if r.startswith("Optimizer.")]  # no step or zero_grad range without a profiler
    seen: list[int] = []
    assert engine.updater is not None
    engine.updater.optimizer.register_step_post_hook(lambda opt, a, k: seen.append(len(opt.state)))
    for _ in range(3):
        assert engine.train_step() is not None
    assert len(seen) == 3 and all(seen)  # after each of the 3 updates, with the optimizer's state made
