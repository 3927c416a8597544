"""The debug hook: guard before the update, hook events and their contexts, replay, break_on, policies."""

from __future__ import annotations

import contextlib
import gc
import inspect
import random
import weakref

import numpy as np
import pytest
import torch
from helpers.models import TinyModel, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

import kit
import kit.debug
from kit.data import Task12AXDataset
from kit.rng import RngState

STEPS_PER_EPOCH = 7  # 40 sequences of Task12AX at batch_size=600, max_seqs=10; random_seed_offset 6: 7 in each epoch under RETURNN's orders


def config(**overrides):
    """One or two short epochs, no eval: a session trains in a fraction of a second."""
    base = dict(train=Task12AXDataset(40, seed=1, seq_ordering="random", random_seed_offset=6), dev=None, num_epochs=1)
    return tiny_config(**{**base, **overrides})


def state_snapshot(session):
    """Parameters and optimizer state (Adam's exp_avg, exp_avg_sq, step), cloned."""
    params = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    opt = {
        k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in session.optimizer.state_dict()["state"].items()
    }
    return params, opt


def same_state(a, b) -> bool:
    (pa, oa), (pb, ob) = a, b
    if pa.keys() != pb.keys() or oa.keys() != ob.keys():
        return False
    if not all(torch.equal(pa[k], pb[k]) for k in pa):
        return False
    return all(
        oa[k].keys() == ob[k].keys()
        and all(
            torch.equal(v, ob[k][n]) if isinstance(v, torch.Tensor) else v == ob[k][n]
            for n, v in oa[k].items()
        )
        for k in oa
    )


class Recorder:
    """A debug hook that records (event, context) and keeps the context like the default hook."""

    def __init__(self, check=None):
        self.calls: list[kit.debug.DebugContext] = []
        self.check = check

    def __call__(self, ctx):
        self.calls.append(ctx)
        kit.debug.capture(ctx)
        if self.check is not None:
            self.check(ctx)

    def events(self, name=None):
        return [c for c in self.calls if name is None or c.event == name]


# ---- models with planted faults -----------------------------------------------------------


class PlantedDiv(torch.nn.Module):
    """Divides by zero at one global train step (the replay runs with the same step, so it fires there too)."""

    def __init__(self, at_step: int):
        super().__init__()
        self.at_step, self.broken = at_step, True

    def forward(self, h):
        ctx = kit.get_run_ctx()
        denom = (
            torch.zeros(()) if self.broken and ctx.train_flag and ctx.step == self.at_step else torch.ones(())
        )
        return h / denom  # PLANTED


class DivModel(TinyModel):
    def __init__(self, at_step: int):
        super().__init__()
        self.scale = PlantedDiv(at_step)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.scale(self.inp(x)))))


class SqrtAtZero(torch.nn.Module):
    """Finite forward, infinite gradient: sqrt(0) at one step."""

    def __init__(self, at_step: int):
        super().__init__()
        self.at_step = at_step

    def forward(self, h):
        ctx = kit.get_run_ctx()
        zero = ctx.train_flag and ctx.step == self.at_step
        return h + torch.sqrt((h * h).sum(-1, keepdim=True) * (0.0 if zero else 1.0))  # SQRT


class SqrtModel(TinyModel):
    def __init__(self, at_step: int):
        super().__init__()
        self.energy = SqrtAtZero(at_step)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.energy(self.inp(x)))))


class Bomb(torch.nn.Module):
    def __init__(self, at_step: int):
        super().__init__()
        self.at_step = at_step

    def forward(self, h):
        if kit.get_run_ctx().train_flag and kit.get_run_ctx().step == self.at_step:
            raise ValueError("planted failure")  # BOMB
        return h


class BombModel(TinyModel):
    def __init__(self, at_step: int):
        super().__init__()
        self.bomb = Bomb(at_step)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.bomb(self.inp(x)))))


class InfGrad(torch.autograd.Function):
    """Identity forward; the backward returns +inf (only when poisoned)."""

    poison = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf")) if InfGrad.poison else grad


class InfGradModel(TinyModel):
    """``out.bias`` reaches the output through InfGrad: only its gradient turns inf."""

    def forward(self, x):
        h = self.drop(torch.tanh(self.inp(x)))
        return torch.nn.functional.linear(h, self.out.weight, InfGrad.apply(self.out.bias))


def line_of(obj, marker: str) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def seq_tag_spy(at_global_step: int, seen: dict):
    """A train_step that remembers the seq tags user code saw at one global step."""
    from helpers.models import train_step

    def spy(*, model, extern_data, **kwargs):
        if kit.get_run_ctx().step == at_global_step:
            seen["tags"] = list(extern_data.seq_tags)
        train_step(model=model, extern_data=extern_data, **kwargs)

    return spy


# ---- the guard fires before the update ----------------------------------------------------


def nan_loss_step(bad_steps):
    """The CE loss is NaN at the given global step(s)."""
    from helpers.models import train_step

    bad_steps = {bad_steps} if isinstance(bad_steps, int) else set(bad_steps)

    def step(*, model, extern_data, **kwargs):
        train_step(model=model, extern_data=extern_data, **kwargs)
        ctx = kit.get_run_ctx()
        if ctx.step in bad_steps:
            ctx.losses["ce"].sum = ctx.losses["ce"].sum * float("nan")

    return step


@pytest.mark.parametrize("guard", [True, False])
def test_nan_loss_leaves_params_and_adam_state_bit_identical(guard):
    k = 3
    session = kit.Session(**config(train_step=nan_loss_step(k), stop_on_nonfinite_train_score=guard))
    session.train_steps(k)
    before = state_snapshot(session)
    assert before[1], "Adam has state after k updates"
    seen_in_hook = []
    session.debug_hook = Recorder(
        check=lambda ctx: seen_in_hook.append(same_state(state_snapshot(session), before))
    )
    if not guard:  # negative control: without the guard the NaN reaches weights and Adam's moments
        session.train_step()
        assert not same_state(state_snapshot(session), before)
        assert not torch.isfinite(session.model.inp.weight).all()
        return
    with pytest.raises(kit.NonFiniteLossError) as info:
        session.train_step()
    assert same_state(state_snapshot(session), before)
    (ctx,) = session.debug_hook.events("nonfinite")
    assert seen_in_hook == [True]  # the hook ran while the state was still the pre-step one
    assert ctx.exception is info.value and "loss ce" in ctx.nonfinite
    assert np.isnan(ctx.losses["ce"]) and np.isfinite(ctx.losses["fer"])
    assert (ctx.epoch, ctx.step, ctx.global_train_step) == (1, k, k)
    assert session.last_failure is ctx


@pytest.mark.parametrize("guard", [True, False])
def test_inf_in_one_gradient_with_a_finite_loss_changes_nothing(guard, monkeypatch):
    k = 2
    from helpers.models import train_step

    def poisoning_step(*, model, extern_data, **kwargs):
        monkeypatch.setattr(InfGrad, "poison", kit.get_run_ctx().step == k)
        train_step(model=model, extern_data=extern_data, **kwargs)

    session = kit.Session(
        **config(
            get_model=lambda **_: InfGradModel(),
            train_step=poisoning_step,
            stop_on_nonfinite_train_score=guard,
        )
    )
    session.debug_hook = Recorder()
    session.train_steps(k)
    before = state_snapshot(session)
    if not guard:  # negative control: the inf gradient reaches out.bias
        session.train_step()
        assert not torch.isfinite(session.model.out.bias).all()
        assert torch.isfinite(session.model.out.weight).all()
        return
    with pytest.raises(kit.NonFiniteLossError):
        session.train_step()
    assert same_state(state_snapshot(session), before)
    (ctx,) = session.debug_hook.events("nonfinite")
    assert all(np.isfinite(v) for v in ctx.losses.values())
    assert [x for x in ctx.nonfinite if not x.startswith("gradient norm")] == ["gradient of out.bias"]


# ---- each event with its context ----------------------------------------------------------


def test_before_train_loop_fires_once_at_the_start_of_every_train_epoch():
    session = kit.Session(**config(num_epochs=3))
    order = []
    session.debug_hook = Recorder(check=lambda ctx: order.append(("hook", ctx.event, ctx.epoch)))
    session.on("step_end", lambda result, **_: order.append(("step", result.epoch, result.step)))
    session.train()
    starts = [(c.epoch, c.step, c.global_train_step) for c in session.debug_hook.events()]
    assert starts == [(e, 0, (e - 1) * STEPS_PER_EPOCH) for e in (1, 2, 3)]
    for epoch in (1, 2, 3):
        i = order.index(("hook", "before_train_loop", epoch))
        assert order[i + 1] == ("step", epoch, 0)  # right before the epoch's first step
        assert epoch == 1 or order[i - 1] == ("step", epoch - 1, STEPS_PER_EPOCH - 1)
    assert session.last_failure is None  # capture keeps failures and breaks only


def test_exception_from_user_code_keeps_its_type_and_carries_the_step_context():
    k = STEPS_PER_EPOCH + 2  # epoch 2, step 2: tells the epoch step from the global step
    seen = {}
    session = kit.Session(
        **config(num_epochs=2, get_model=lambda **_: BombModel(k), train_step=seq_tag_spy(k, seen))
    )
    session.debug_hook = Recorder()
    with pytest.raises(ValueError, match="planted failure") as info:
        session.train()
    (ctx,) = session.debug_hook.events("exception")
    assert ctx.exception is info.value and type(ctx.exception) is ValueError
    assert (ctx.epoch, ctx.step, ctx.global_train_step, ctx.stage) == (2, 2, k, "train")
    assert ctx.module_stack == ["(BombModel.forward) (root)", "(Bomb.forward) bomb"]
    assert ctx.batch["data"].tensor.device.type == "cpu"
    assert ctx.seq_tags == seen["tags"] and len(ctx.seq_tags) > 0
    assert ctx.model is session.model and ctx.optimizer is session.optimizer
    assert torch.equal(ctx.rng_state.torch, ctx.rng_state.torch) and ctx.rng_state.torch.dtype == torch.uint8
    assert session.last_failure is ctx
    assert "bomb" in str(ctx) and "ValueError" in str(ctx)


def test_exception_in_eval_and_forward_reaches_the_hook():
    from helpers.models import train_step

    def failing_in_eval(*, model, extern_data, **kwargs):
        if not kit.get_run_ctx().train_flag:
            raise KeyError("eval only")
        train_step(model=model, extern_data=extern_data, **kwargs)

    def failing_forward(*, model, extern_data, **kwargs):
        raise RuntimeError("forward broke")

    session = kit.Session(**config(train_step=failing_in_eval, forward_step=failing_forward))
    session.debug_hook = Recorder()
    with pytest.raises(KeyError):
        session.eval({"dev": Task12AXDataset(10, seed=3)})
    with pytest.raises(RuntimeError, match="forward broke"):
        session.forward(Task12AXDataset(10, seed=3))
    stages = [(c.event, c.stage, type(c.exception).__name__) for c in session.debug_hook.events()]
    assert stages == [("exception", "eval", "KeyError"), ("exception", "forward", "RuntimeError")]
    assert all(c.batch is not None and c.batch.seq_tags for c in session.debug_hook.calls)
    for ctx in session.debug_hook.calls:  # both replay in their own stage, without gradients
        report = session.replay(ctx)
        assert report.reproduced and report.error.startswith(type(ctx.exception).__name__)


def test_nonfinite_event_comes_before_the_error_with_policy_raise():
    k = 4
    session = kit.Session(**config(get_model=lambda **_: DivModel(k)))
    log = []
    session.debug_hook = Recorder(check=lambda ctx: log.append(ctx.event))
    with pytest.raises(kit.NonFiniteLossError) as info:
        session.train()
    log.append("raised")
    assert log == ["before_train_loop", "nonfinite", "raised"]
    ctx = session.last_failure
    assert ctx.exception is info.value and (ctx.step, ctx.global_train_step) == (k, k)
    assert "gradient of inp.weight" in ctx.nonfinite and not any(x.startswith("loss") for x in ctx.nonfinite)
    assert session.global_train_step == k  # the failed step does not count


# ---- replay -------------------------------------------------------------------------------


def test_replay_names_the_planted_division_and_reproduces_the_failure():
    k = 4
    session = kit.Session(**config(get_model=lambda **_: DivModel(k)))
    with pytest.raises(kit.NonFiniteLossError):
        session.train()
    ctx = session.last_failure
    params = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    for p in session.model.parameters():  # distinctive gradients, which the replay must not touch
        p.grad = torch.full_like(p, 7.0)
    grads = {n: p.grad for n, p in session.model.named_parameters()}
    outer_rng = torch.get_rng_state()

    report = session.replay()
    assert report.reproduced and report.found
    assert report.op.startswith("aten.div") and report.module == "scale"
    assert report.finding.phase == "forward" and report.finding.inputs_finite
    assert report.location.startswith(f"{__file__}:{line_of(PlantedDiv.forward, '# PLANTED')} ")
    assert report.nonfinite == [x for x in ctx.nonfinite if x.startswith("gradient of")]
    assert report.losses == pytest.approx(ctx.losses)
    assert "aten.div" in str(report) and "module scale (PlantedDiv)" in str(report)
    assert "aten.div" in report._repr_html_()
    # nothing changed: parameters, gradients (same tensors, same values), RNG
    assert all(torch.equal(p, params[n]) for n, p in session.model.named_parameters())
    assert all(p.grad is grads[n] and bool((p.grad == 7).all()) for n, p in session.model.named_parameters())
    assert torch.equal(torch.get_rng_state(), outer_rng)
    assert session.model.training

    # negative control: the same batch under another dropout mask gives other losses
    ctx.rng_state = RngState(torch.Generator().manual_seed(123).get_state())
    other = session.replay(ctx)
    assert other.found and not other.reproduced and "NOT reproduced" in str(other)


class NormModel(TinyModel):
    """With BatchNorm: buffers that a train-mode forward would update."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        h = self.norm(self.inp(x).transpose(1, 2)).transpose(1, 2)
        return self.out(self.drop(torch.tanh(h)))


def test_replay_keeps_buffers_and_each_module_mode():
    session = kit.Session(**config(get_model=lambda **_: NormModel()))
    session.break_on(step=1)
    ctx = session.train().debug
    session.model.drop.eval()  # a mixed state the replay must give back as it was
    buffers = {n: b.clone() for n, b in session.model.named_buffers()}
    report = session.replay(ctx)
    assert report.error is None and set(report.losses) == {"ce", "fer"}
    assert all(torch.equal(b, buffers[n]) for n, b in session.model.named_buffers())
    assert session.model.training and session.model.norm.training and not session.model.drop.training


def test_replay_traces_a_backward_only_nan_to_its_forward_line():
    k = 3
    session = kit.Session(**config(get_model=lambda **_: SqrtModel(k)))
    with pytest.raises(kit.NonFiniteLossError):
        session.train()
    report = session.replay()
    assert report.reproduced and report.finding.phase == "backward"
    assert report.finding.grad_fn == "SqrtBackward0" and report.module == "energy"
    assert report.location.startswith(f"{__file__}:{line_of(SqrtAtZero.forward, '# SQRT')} ")
    plain = session.replay(anomaly=False)  # without tracing back: only the backward node is named
    assert plain.finding.grad_fn == "SqrtBackward0" and plain.module is None


class _NaNGarbage(TorchDispatchMode):
    """Uninitialised memory that happens to hold NaN, as it sometimes does after other tests."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "empty_like":
            out.fill_(float("nan"))
        return out


def test_replay_ignores_nan_garbage_in_uninitialised_memory():
    session = kit.Session(**config(get_model=lambda **_: SqrtModel(3)))
    with pytest.raises(kit.NonFiniteLossError):
        session.train()
    with _NaNGarbage():  # dropout's mask starts as empty_like(...) before bernoulli_ fills it
        report = session.replay()
    assert report.finding.phase == "backward" and report.finding.grad_fn == "SqrtBackward0"


def test_replay_of_an_exception_reproduces_it():
    k = 2
    session = kit.Session(**config(get_model=lambda **_: BombModel(k)))
    with pytest.raises(ValueError):
        session.train()
    report = session.replay()
    assert report.error.startswith("ValueError: planted failure") and report.reproduced and not report.found
    session.model.bomb.at_step = -1  # fixed: the replay no longer raises
    assert not session.replay().reproduced


# ---- break_on -----------------------------------------------------------------------------


def uninterrupted_params(**overrides):
    session = kit.Session(**config(**overrides))
    session.train()
    return {n: p.detach().clone() for n, p in session.model.named_parameters()}


def params_equal_to(session, params) -> bool:
    return all(torch.equal(p, params[n]) for n, p in session.model.named_parameters())


def test_break_on_returns_the_context_and_continuing_equals_an_uninterrupted_run():
    k = STEPS_PER_EPOCH + 3
    reference = uninterrupted_params(num_epochs=2)
    seen = {}
    session = kit.Session(**config(num_epochs=2, train_step=seq_tag_spy(k, seen)))
    session.debug_hook = Recorder()
    session.break_on(step=2)
    early = session.train().debug
    session.break_on(step=k)
    ctx = session.train().debug
    assert isinstance(ctx, kit.debug.DebugContext) and ctx.event == "step"
    assert (ctx.epoch, ctx.step, ctx.global_train_step) == (2, 3, k)
    assert ctx.seq_tags == seen["tags"] and set(ctx.losses) == {"ce", "fer"}
    assert session.debug_hook.events("step") == [early, ctx] and session.last_failure is ctx
    assert session.global_train_step == k + 1
    grads = {n: p.grad.clone() for n, p in session.model.named_parameters()}
    report = session.replay(early)  # replaying an older step changes nothing either (RNG, grads)
    assert not report.found and report.error is None
    assert all(torch.equal(p.grad, grads[n]) for n, p in session.model.named_parameters())
    session.train()
    assert session.global_train_step == 2 * STEPS_PER_EPOCH
    assert params_equal_to(session, reference)


def test_break_on_when_stops_at_every_match():
    reference = uninterrupted_params(num_epochs=2)
    session = kit.Session(**config(num_epochs=2), debug_hook=None)
    session.break_on(when=lambda result: result.global_train_step in (1, 5, 9))
    stops = []
    while (out := session.train()).outcome == "break":
        stops.append((out.debug.event, out.debug.global_train_step))
    assert stops == [("step", 1), ("step", 5), ("step", 9)]  # a context even without a hook
    assert params_equal_to(session, reference)
    session.break_on()  # clears
    assert session._parts.breakpoints.when is None and session._parts.breakpoints.step is None


@pytest.mark.parametrize("kept", [True, False])
def test_a_hook_that_uses_randomness_does_not_change_training(kept, monkeypatch):
    reference = uninterrupted_params(num_epochs=2)
    if not kept:  # negative control: without putting the RNG states back, the run changes
        monkeypatch.setattr(kit.engine.debugging, "rng_kept", contextlib.nullcontext)

    def noisy_hook(ctx):
        torch.rand(3), np.random.rand(), random.random()

    session = kit.Session(**config(num_epochs=2), debug_hook=noisy_hook)
    session.break_on(step=4)
    assert session.train().debug.event == "step"
    session.train()
    assert params_equal_to(session, reference) is kept


# ---- policies and built-in hooks ------------------------------------------------------------


def test_skip_policy_counts_skipped_updates_and_stops_after_too_many_in_a_row():
    bad_steps = {2} | set(range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH))
    session = kit.Session(
        **config(
            num_epochs=2,
            train_step=nan_loss_step(bad_steps),
            nonfinite_policy="skip",
            num_allowed_consec_invalid_gradient_steps=2,
        )
    )
    session.debug_hook = Recorder()
    session.train_epoch()
    assert session.score_table.meta(1)["skipped_updates"] == 1
    assert session.progress.num_updates == STEPS_PER_EPOCH - 1
    with pytest.raises(kit.NonFiniteLossError, match="num_allowed_consec_invalid_gradient_steps=2") as info:
        session.train_epoch()
    first_bad = STEPS_PER_EPOCH + 1
    assert info.value.step == first_bad + 2 - STEPS_PER_EPOCH  # the third in a row stops
    assert [c.global_train_step for c in session.debug_hook.events("nonfinite")] == [
        2,
        first_bad,
        first_bad + 1,
        first_bad + 2,
    ]
    assert session.progress.num_updates == STEPS_PER_EPOCH - 1 + 1  # step 7 updated, 8..10 did not


def test_raise_hook_reraises_the_exception_and_stops_at_skippable_nonfinite_steps():
    session = kit.Session(**config(get_model=lambda **_: BombModel(1)), debug_hook=kit.debug.raise_)
    with pytest.raises(ValueError, match="planted failure") as info:
        session.train()
    assert session.last_failure.exception is info.value

    session = kit.Session(
        **config(get_model=lambda **_: DivModel(3), nonfinite_policy="skip"), debug_hook=kit.debug.raise_
    )
    with pytest.raises(kit.NonFiniteLossError):  # not skipped: the hook raised
        session.train()
    assert session.global_train_step == 3

    session = kit.Session(**config(), debug_hook=kit.debug.raise_)
    session.break_on(step=2)
    with pytest.raises(kit.debug.DebugStop) as stop:
        session.train()
    assert stop.value.context.global_train_step == 2 and stop.value.context.event == "step"


@pytest.mark.parametrize("with_ipython", [True, False])
def test_post_mortem_opens_the_debugger_on_the_exception_traceback(with_ipython, monkeypatch, capsys):
    import pdb
    import sys

    if with_ipython:
        debugger_cls = pytest.importorskip("IPython.core.debugger").Pdb
    else:
        monkeypatch.setitem(sys.modules, "IPython.core.debugger", None)  # import fails: plain Python
        debugger_cls = pdb.Pdb
    calls = []

    def interaction(self, frame, tb):
        calls.append((type(self), frame, tb))

    monkeypatch.setattr(debugger_cls, "interaction", interaction)
    session = kit.Session(**config(get_model=lambda **_: BombModel(2)), debug_hook=kit.debug.post_mortem)
    with pytest.raises(ValueError) as info:
        session.train()
    ((cls, frame, tb),) = calls
    assert cls is debugger_cls and frame is None
    chain, t = [], info.value.__traceback__
    while t is not None:
        chain.append(t)
        t = t.tb_next
    assert tb in chain  # the traceback the error propagated with
    assert (chain[-1].tb_frame.f_code.co_name, chain[-1].tb_lineno) == (
        "forward",
        line_of(Bomb.forward, "# BOMB"),
    )
    assert "planted failure" in capsys.readouterr().out

    session = kit.Session(**config(get_model=lambda **_: DivModel(1)), debug_hook=kit.debug.post_mortem)
    with pytest.raises(kit.NonFiniteLossError):
        session.train()
    assert len(calls) == 1 and "session.replay()" in capsys.readouterr().out  # nothing to step through


# ---- releasing memory, config -------------------------------------------------------------


@pytest.mark.parametrize("release", [True, False])
def test_release_drops_the_captured_batch(release):
    session = kit.Session(**config(get_model=lambda **_: DivModel(2)))
    with pytest.raises(kit.NonFiniteLossError):
        session.train()
    ref = weakref.ref(session.last_failure.batch["data"].tensor)
    if release:
        session.release()
        assert session.last_failure is None
    gc.collect()
    assert (ref() is None) is release  # negative control: without release the copy stays alive


def test_close_releases_the_captured_batch_too():
    session = kit.Session(**config(get_model=lambda **_: DivModel(2)))
    with pytest.raises(kit.NonFiniteLossError):
        session.train()
    ref = weakref.ref(session.last_failure.batch["data"].tensor)
    session.close()
    gc.collect()
    assert ref() is None
    with pytest.raises(kit.errors.KitError, match="no captured batch"):
        kit.debug.replay(session._parts.engine, kit.debug.DebugContext("step", 1, 0, 0))


def test_debug_shell_before_train_loop_is_replaced_by_debug_hook(tmp_path):
    with pytest.raises(kit.ConfigError, match="debug_hook"):
        kit.Session(**config(), debug_shell_before_train_loop=True)
    path = tmp_path / "config.py"
    path.write_text("debug_shell_before_train_loop = True\nnum_epochs = 1\n")
    with pytest.raises(kit.ConfigError, match="debug_hook") as info:
        kit.Session.from_config(path)
    assert "debug_shell_before_train_loop" in str(info.value)
    path.write_text("import kit.debug\ndebug_hook = kit.debug.raise_\n")
    assert kit.Session.from_config(path).debug_hook is kit.debug.raise_
    assert kit.Session().debug_hook is kit.debug.capture  # the default


def test_config_debug_hook_works_without_a_session():
    """The CLI and torchrun drive the Engine directly: the config's debug_hook reaches them too."""
    from kit.engine.engine import Engine

    recorder = Recorder()
    engine = Engine(kit.Config(config(get_model=lambda **_: BombModel(1), debug_hook=recorder)))
    engine.train_step()
    with pytest.raises(ValueError, match="planted failure"):
        engine.train_step()
    assert [c.event for c in recorder.calls] == ["before_train_loop", "exception"]
    assert recorder.calls[-1].global_train_step == 1 and engine.last_failure is recorder.calls[-1]
    assert Engine(kit.Config(config())).debugger is None  # no hook, no context building at all


@pytest.mark.parametrize("patched", [True, False])
def test_train_eval_and_replay_run_the_same_step_code(patched, monkeypatch):
    """kit.engine.compute.Compute.forward is the one forward: a change there reaches training, eval and replay."""
    from kit.engine.compute import Compute

    real = Compute.forward

    def forward(self, fn, ctx, batch):
        def with_extra(**kwargs):
            fn(**kwargs)
            kit.get_run_ctx().mark_as_loss(torch.tensor(7.0), "extra")

        real(self, with_extra, ctx, batch)

    if patched:  # negative control: without it no step marks "extra"
        monkeypatch.setattr(Compute, "forward", forward)
    session = kit.Session(**config(num_epochs=1))
    session.break_on(step=2)
    ctx = session.train().debug
    assert ("extra" in ctx.losses) is patched
    report = session.replay(ctx)  # after a step break the weights are updated: losses differ, names do not
    assert ("extra" in report.losses) is patched and report.losses.keys() == ctx.losses.keys()
    assert ("eval_loss_extra" in session.eval(Task12AXDataset(20, seed=3))["eval"]) is patched
