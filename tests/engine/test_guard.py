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
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
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
    with engine.driver_call():
        for _ in range(steps):
            engine.train_step()


def poisoned_step(*, loss_at=(), aux_at=()):
    """A train_step whose loss (NaN) or a detached aux loss (NaN) is non-finite on the given batches of
    epoch 1 (``batch_idx``: the global step of an uninterrupted run). A bad batch is bad whenever it is
    trained (a deferred rewind trains it again); the step after a reported one takes the next batch."""

    def train_step(*, model, extern_data, **_kwargs):
        ctx = kit.get_run_ctx()
        bad = extern_data.batch_idx if ctx.epoch == 1 else None
        s, n = masked_ce(model, extern_data)
        if bad in loss_at:
            s = s * float("nan")
        ctx.mark_as_loss(s, "ce", custom_inv_norm_factor=n)
        aux = torch.tensor(float("nan") if bad in aux_at else 1.0)
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


@pytest.mark.parametrize("loss_dtype", [torch.float32, torch.float64])
def test_the_check_finds_the_inf_beside_losses_of_another_dtype(loss_dtype):
    state: dict = {}

    def train_step(*, model, extern_data, **_kwargs):
        state["poison"] = kit.get_run_ctx().step == 2
        s, n = masked_ce(model, extern_data)
        kit.get_run_ctx().mark_as_loss(s.to(loss_dtype), "ce", custom_inv_norm_factor=n)

    engine = make_engine(get_model=inf_grad_model(state), train_step=train_step)
    run(engine, 2)
    before = snapshot(engine)
    with pytest.raises(kit.NonFiniteLossError) as info:
        run(engine, 1)
    assert info.value.global_train_step == 2 and "gradient of out.bias" in str(info.value)
    assert equal(snapshot(engine), before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_nonfinite_is_exact(dtype):
    from kit.engine.guard import any_nonfinite

    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # summing or squaring these overflows
    assert not bool(any_nonfinite([big, -big, torch.zeros(3, dtype=dtype)]))
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(7, dtype=dtype)
        t[5] = bad
        assert bool(any_nonfinite([big, t])), bad
    assert bool(any_nonfinite([torch.tensor([math.inf, -math.inf], dtype=dtype)]))


# ---- item 11: value clipping must not hide Inf ---------------------------------------------------


def poison_at(state: dict, *steps: int):
    """A train_step that poisons the model's ``out.bias`` gradient (``inf_grad_model``) at global ``steps``."""

    def train_step(*, model, extern_data, **_kwargs):
        state["poison"] = kit.get_run_ctx().step in steps
        s, n = masked_ce(model, extern_data)
        kit.get_run_ctx().mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    return train_step


@pytest.mark.parametrize("mode", MODES)
def test_value_clipping_does_not_hide_an_inf_gradient(mode):
    state: dict = {}
    engine = make_engine(get_model=inf_grad_model(state), train_step=poison_at(state, 1), gradient_clip=1.0,
                         **mode_keys(mode))
    run(engine, 1)
    before = snapshot(engine)
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
    from kit.rng import RngState

    monkeypatch.setattr(RngState, "restore", lambda self: None)
    with pytest.raises(AssertionError):
        rewind_parity(host_rng=False)


@pytest.mark.parametrize("optimizer", [{"class": "adam"}, {"class": "adamw", "fused": True}])
def test_deferred_steps_after_a_bad_step_are_undone_when_the_call_ends(optimizer):
    state: dict = {}
    engine = make_engine(get_model=inf_grad_model(state), train_step=poison_at(state, 2), optimizer=optimizer,
                         nonfinite_check="deferred")
    run(engine, 2)
    before = snapshot(engine)
    call = engine.driver_call()  # a driver's call that has not ended yet
    call.__enter__()
    for _ in range(3):  # the bad step 2, then two more, none of them read
        engine.train_step()
    with pytest.raises(kit.NonFiniteLossError) as info:
        call.__exit__(None, None, None)
    assert info.value.global_train_step == 2
    assert equal(snapshot(engine), before)
    assert engine.progress.global_train_step == 2


def test_deferred_rewind_of_a_step_that_is_finite_when_trained_again_says_so():
    state: dict = {"runs": 0}

    def once(*, model, extern_data, **_kwargs):  # non-finite only the first time step 2 runs
        step = kit.get_run_ctx().step
        state["runs"] += step == 2
        state["poison"] = step == 2 and state["runs"] == 1
        s, n = masked_ce(model, extern_data)
        kit.get_run_ctx().mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    engine = make_engine(get_model=inf_grad_model(state), train_step=once, nonfinite_check="deferred")
    run(engine, 2)
    with pytest.raises(kit.NonFiniteLossError, match="not deterministic"):
        run(engine, 3)
    assert engine.progress.global_train_step == 3  # steps 2 (again, finite) trained; 3 and 4 undone
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())


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
