"""The non-finite guard (kit/engine/guard.py): what it catches, whom it blames, what it leaves.

Each test runs in both modes where that matters: ``immediate`` (the flag read after every
micro-batch, the CPU default) and ``deferred`` (no read per step, the accelerator default:
the update is skipped on the device and the session rewound when the flag is read).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from helpers.models import TinyModel, tiny_config

import kit
from kit.engine.engine import Engine

MODES = ["immediate", "deferred"]


def mode_keys(mode: str) -> dict:
    """Immediate is the default on a CPU device ("auto"): the key is set for deferred only."""
    return {"nonfinite_check": mode} if mode == "deferred" else {}


def make_engine(**overrides) -> Engine:
    overrides.setdefault("get_model", lambda **_: TinyModel(dropout=0.0))
    return Engine(kit.Config(tiny_config(None, **overrides)))


def masked_ce(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["data"].tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["classes"].tensor, reduction="none")
    mask = batch["classes"].mask()
    return torch.where(mask, ce, 0).sum(), mask.sum()


def snapshot(engine: Engine) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in engine.model.named_parameters()},
        "buffers": {n: b.clone() for n, b in engine.model.named_buffers()},
        "optimizer": copy.deepcopy(engine.updater.optimizer.state_dict()),
    }


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def run(engine: Engine, steps: int) -> None:
    """``steps`` train steps inside one driver call (the deferred mode reads when it ends)."""
    with engine.guard.deferred_reads():
        for _ in range(steps):
            engine.train_step()


def poisoned_step(*, loss_at=(), aux_at=()):
    """A train_step whose loss (NaN) or a detached aux loss (NaN) is non-finite at the given
    global steps, the first time each of them runs (a step rerun after a rewind is finite)."""
    done: set = set()

    def train_step(*, model, extern_data, **_kwargs):
        ctx = kit.get_run_ctx()
        s, n = masked_ce(model, extern_data)
        if ctx.step in loss_at and ctx.step not in done:
            done.add(ctx.step)
            s = s * float("nan")
        ctx.mark_as_loss(s, "ce", custom_inv_norm_factor=n)
        aux = torch.tensor(float("nan") if ctx.step in set(aux_at) - done else 1.0)
        done.update(set(aux_at) & {ctx.step})
        ctx.mark_as_loss(aux, "aux", as_error=True)  # no gradient at all

    return train_step


def inf_grad_model(state: dict):
    def get_model(**_):
        model = TinyModel(dropout=0.0)
        model.out.bias.register_hook(lambda g: torch.full_like(g, math.inf) if state.get("poison") else g)
        return model

    return get_model


# ---- issue 11, item 9: every micro-batch's losses -----------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_nan_loss_of_a_non_final_micro_batch_is_caught(mode):
    engine = make_engine(train_step=poisoned_step(aux_at=(2,)), accum_grad_multiple_step=2, **mode_keys(mode))
    run(engine, 2)
    before = snapshot(engine)
    with pytest.raises(kit.NonFiniteLossError) as info:
        run(engine, 2)  # micro-batch 2 (finite gradients, NaN aux loss), then 3 closes the window
    assert (info.value.step, info.value.global_train_step) == (2, 2) and "loss aux" in str(info.value)
    assert equal(snapshot(engine), before)
    assert engine.progress.num_updates == 1


# ---- item 10: the micro-batch to blame ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_micro_batch_whose_gradient_turned_non_finite_is_named_and_kept(mode):
    state: dict = {}

    def train_step(*, model, extern_data, **_kwargs):
        state["poison"] = kit.get_run_ctx().step == 4  # the first micro-batch of the third window
        s, n = masked_ce(model, extern_data)
        kit.get_run_ctx().mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    session = kit.Session(tiny_config(None, get_model=inf_grad_model(state), train_step=train_step,
                                      accum_grad_multiple_step=2, **mode_keys(mode)))
    batches = []
    session.on("step_begin", lambda batch, **_: batches.append(batch.seq_tags))
    with pytest.raises(kit.NonFiniteLossError) as info:
        session.train_steps(8)
    assert info.value.step == 4 and "step 4 " in str(info.value)
    assert session.last_failure.global_train_step == 4
    assert session.last_failure.seq_tags == batches[4]
    if mode == "immediate":
        assert "gradient of out.bias" in str(info.value)
    assert session.global_train_step == 4 and len(session.history) == 4


def test_the_fused_check_gets_one_dtype_per_call_and_finds_the_inf(monkeypatch):
    """The fused op reads every tensor of a call as the first one's dtype (on CUDA a mix is misread
    without an error): a float64 loss beside float32 gradients is checked in a call of its own,
    the usual all-float32 step in one call, and the Inf gradient is found either way."""
    fused = torch._amp_foreach_non_finite_check_and_unscale_
    calls: list[list[torch.dtype]] = []

    def recording(tensors, found, inv_scale):
        calls.append([t.dtype for t in tensors])
        return fused(tensors, found, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", recording)
    for loss_dtype in (torch.float32, torch.float64):
        state: dict = {}

        def train_step(*, model, extern_data, _dtype=loss_dtype, _state=state, **_kwargs):
            _state["poison"] = kit.get_run_ctx().step == 2
            s, n = masked_ce(model, extern_data)
            kit.get_run_ctx().mark_as_loss(s.to(_dtype), "ce", custom_inv_norm_factor=n)

        engine = make_engine(get_model=inf_grad_model(state), train_step=train_step)
        run(engine, 2)
        before = snapshot(engine)
        calls.clear()
        with pytest.raises(kit.NonFiniteLossError) as info:
            run(engine, 1)
        assert info.value.global_train_step == 2 and "gradient of out.bias" in str(info.value)
        assert equal(snapshot(engine), before)
        assert all(len(set(dtypes)) == 1 for dtypes in calls)  # never a mix in one call
        assert len(calls) == (1 if loss_dtype == torch.float32 else 2)


# ---- item 11: value clipping must not hide Inf ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_value_clipping_does_not_hide_an_inf_gradient(mode):
    state: dict = {}
    engine = make_engine(get_model=inf_grad_model(state), gradient_clip=1.0, **mode_keys(mode))
    run(engine, 1)
    before = snapshot(engine)
    state["poison"] = True
    with pytest.raises(kit.NonFiniteLossError):
        run(engine, 1)
    assert equal(snapshot(engine), before)


# ---- item 12: learning rates --------------------------------------------------------------------


@pytest.mark.parametrize("keys", [{"learning_rate": math.inf}, {"learning_rates": [0.1, math.inf]},
                                  {"learning_rates": {1: 0.1, 2: math.inf}}])
def test_a_non_finite_static_learning_rate_is_a_config_error(keys):
    with pytest.raises(kit.ConfigError) as info:
        kit.Config(tiny_config(None, **keys))
    assert list(keys)[0] in str(info.value)


def test_a_non_finite_dynamic_learning_rate_never_reaches_the_optimizer():
    engine = make_engine(dynamic_learning_rate=lambda *, global_train_step, learning_rate, **_:
                         math.nan if global_train_step == 1 else learning_rate)
    run(engine, 1)
    before = snapshot(engine)
    with pytest.raises(kit.ConfigError) as info:
        run(engine, 1)
    assert "dynamic_learning_rate" in str(info.value) and "global step 1" in str(info.value)
    assert equal(snapshot(engine), before)


# ---- item 13: module buffers ------------------------------------------------------------------


class NormModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(9, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(torch.tanh(self.norm(h.transpose(1, 2)).transpose(1, 2)))


def nan_frame_step(at: int):
    def train_step(*, model, extern_data, **_kwargs):
        x = extern_data["data"].tensor
        if kit.get_run_ctx().train_flag and kit.get_run_ctx().step == at:
            x = x.clone()
            x[0, 0, 0] = math.nan  # one frame
        logits = model(x)
        classes = extern_data["classes"]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
        kit.get_run_ctx().mark_as_loss(ce, "ce", mask=classes.mask())

    return train_step


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_step_leaves_batchnorm_statistics_as_they_were(mode):
    engine = make_engine(get_model=lambda **_: NormModel(), train_step=nan_frame_step(2), **mode_keys(mode))
    run(engine, 2)
    before = snapshot(engine)
    with pytest.raises(kit.NonFiniteLossError) as info:
        run(engine, 3)
    assert equal(snapshot(engine), before)
    assert "module buffers are as before it" in str(info.value)


def test_skip_policy_keeps_batchnorm_statistics_and_dev_scores_finite():
    engine = make_engine(get_model=lambda **_: NormModel(), train_step=nan_frame_step(2), nonfinite_policy="skip",
                         num_epochs=1)
    row = engine.train_epoch()
    assert engine.progress.skipped_updates_in_epoch == 1
    assert all(torch.isfinite(b.float()).all() for b in engine.model.buffers())
    assert math.isfinite(row["dev_loss_ce"])


# ---- issue 15, item 4: deferred reads rewind to right after the bad step ----------------------


def numpy_drawing(train_step):
    """``train_step`` plus a loss term drawn from numpy's global RNG (as augmentation code does)."""

    def wrapped(*, model, extern_data, **kwargs):
        train_step(model=model, extern_data=extern_data, **kwargs)
        kit.get_run_ctx().mark_as_loss(torch.tensor(float(np.random.rand())), "noise", as_error=True)

    return wrapped


@pytest.mark.parametrize("host_rng", [False, True])
def test_deferred_report_rewinds_like_an_immediate_one(host_rng):
    """Both modes raise at step 3; the session stands right after it, so training on from there
    ends on the same weights, optimizer state (Adam's step counts), counters and RNG (numpy's
    too, once a first read period has seen it drawn from)."""
    rewind_parity(host_rng)


def rewind_parity(host_rng: bool) -> None:
    ends = {}
    for mode in MODES:
        step = poisoned_step(loss_at=(3,))
        engine = make_engine(get_model=lambda **_: TinyModel(dropout=0.3),
                             train_step=numpy_drawing(step) if host_rng else step, **mode_keys(mode))
        run(engine, 2)
        with pytest.raises(kit.NonFiniteLossError) as info:
            run(engine, 5)  # steps 2..6: deferred runs 4..6 and undoes them
        assert info.value.global_train_step == 3
        p = engine.progress
        assert (p.global_train_step, p.step_in_epoch, p.num_updates) == (3, 3, 3)
        run(engine, 3)  # steps 3, 4, 5 on the batches after the bad one
        ends[mode] = (snapshot(engine), engine.progress.state_dict(), torch.get_rng_state(),
                      np.random.get_state()[1].tolist())
    assert equal(ends["immediate"], ends["deferred"])


def test_deferred_rewind_negative_control_without_the_rng(monkeypatch):
    # the parity above needs the RNG put back: without it the dropout masks differ
    from kit.engine import guard

    monkeypatch.setattr(guard, "restore_rng", lambda snapshot: None)
    with pytest.raises(AssertionError):
        rewind_parity(host_rng=False)


@pytest.mark.parametrize("optimizer", [{"class": "adam"}, {"class": "adamw", "fused": True}])
def test_deferred_updates_after_a_bad_step_are_no_ops(optimizer):
    state: dict = {}
    engine = make_engine(get_model=inf_grad_model(state), optimizer=optimizer, nonfinite_check="deferred")
    run(engine, 2)
    before = snapshot(engine)
    call = engine.guard.deferred_reads()  # a driver's call that has not ended yet
    call.__enter__()
    state["poison"] = True
    engine.train_step()
    state["poison"] = False
    engine.train_step()
    engine.train_step()
    assert equal(snapshot(engine)["params"], before["params"])  # on the device, before any read
    with pytest.raises(kit.NonFiniteLossError):
        call.__exit__(None, None, None)
    assert equal(snapshot(engine), before)


def test_deferred_history_and_data_continue_after_the_bad_step():
    session = kit.Session(tiny_config(None, get_model=lambda **_: TinyModel(dropout=0.0),
                                      train_step=poisoned_step(loss_at=(3,)), nonfinite_check="deferred"))
    seen = []
    session.on("step_begin", lambda batch, **_: seen.append(batch.batch_idx))
    with pytest.raises(kit.NonFiniteLossError):
        session.train_steps(6)
    assert list(session.history["global_train_step"]) == [0, 1, 2]
    session.train_steps(2)
    assert seen[-2:] == [4, 5]  # the batches after the bad one
    assert list(session.history["global_train_step"]) == [0, 1, 2, 3, 4]


def test_deferred_and_skip_policy_is_a_config_error():
    engine = make_engine(nonfinite_check="deferred", nonfinite_policy="skip")
    with pytest.raises(kit.ConfigError) as info:
        engine.train_step()
    assert "nonfinite_check" in str(info.value)
