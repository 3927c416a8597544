"""``torch_amp`` and ``grad_scaler`` through the real Engine, on CPU autocast.

A GradScaler exists only for float16 by default (RETURNN also makes one for bfloat16,
which needs none); ``grad_scaler`` overrides either way.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.models import TinyModel, tiny_config

import kit
from kit.engine.engine import Engine


def make_engine(**overrides) -> Engine:
    overrides.setdefault("get_model", lambda **_: TinyModel(dropout=0.0))
    engine = Engine(kit.Config(tiny_config(None, **overrides)))
    engine.setup()
    return engine


@pytest.mark.parametrize(
    "keys, expected_scale",
    [
        ({}, None),
        ({"torch_amp": "bfloat16"}, None),
        ({"torch_amp": "float16"}, 2.0**16),
        ({"torch_amp": "float16", "grad_scaler": False}, None),
        ({"torch_amp": "bfloat16", "grad_scaler": {"init_scale": 8.0}}, 8.0),
        ({"torch_amp": "bfloat16", "grad_scaler": True}, 2.0**16),
        ({"torch_amp": {"dtype": "float16", "grad_scaler": {"init_scale": 4.0}}}, 4.0),
        ({"torch_amp": {"dtype": "float16", "grad_scaler": False}}, None),
    ],
    ids=["off", "bf16", "fp16", "fp16-off", "bf16-dict", "bf16-true", "amp-dict", "amp-dict-off"],
)
def test_grad_scaler_only_for_float16_unless_overridden(keys, expected_scale):
    engine = make_engine(**keys)
    if expected_scale is None:
        assert engine.compute.grad_scaler is None
    else:
        assert isinstance(engine.compute.grad_scaler, torch.amp.GradScaler)
        assert engine.compute.grad_scaler.get_scale() == expected_scale


def test_bad_grad_scaler_options_are_a_config_error():
    with pytest.raises(kit.ConfigError, match="grad_scaler"):
        make_engine(torch_amp="float16", grad_scaler={"no_such_option": 1})


def _recording_step(seen: list):
    def train_step(*, model, extern_data, **_kwargs):
        classes = extern_data["classes"]
        logits = model(extern_data["data"].tensor)
        seen.append(logits.dtype)
        ce = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), classes.tensor, reduction="none"
        )
        kit.get_run_ctx().mark_as_loss(ce, "ce", mask=classes.mask())

    return train_step


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_train_steps_run_under_cpu_autocast(dtype):
    seen = []
    keys = {"grad_scaler": {"init_scale": 2.0**8}} if dtype == "float16" else {}
    engine = make_engine(
        torch_amp=dtype, train_step=_recording_step(seen), optimizer={"class": "sgd"}, **keys
    )
    before = copy.deepcopy(engine.model)
    results = [engine.train_step() for _ in range(3)]
    assert seen == [getattr(torch, dtype)] * 3  # the model ran in the autocast dtype
    assert all(r.updated and math.isfinite(r.losses["ce"]) for r in results)
    assert not torch.equal(before.inp.weight, engine.model.inp.weight)
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # master weights stay fp32
    if dtype == "float16":
        assert engine.compute.grad_scaler.get_scale() == 2.0**8  # no overflow: the scale stayed


def test_float16_gradients_are_unscaled_before_the_update():
    # the kept gradient of the last window equals the unscaled fp16-autocast gradient
    seen = []
    engine = make_engine(
        torch_amp="float16",
        grad_scaler={"init_scale": 2.0**10},
        train_step=_recording_step(seen),
        optimizer={"class": "sgd"},
    )
    model0 = copy.deepcopy(engine.model)
    engine.train_step()
    from kit.data import batches

    cfg = tiny_config(None)
    batch = next(iter(batches(cfg["train"], extern_data=cfg["extern_data"], batch_size=600, max_seqs=10)))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model0(batch["data"].tensor)
    ce = torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), batch["classes"].tensor, reduction="none"
    )
    torch.where(batch["classes"].mask(), ce, 0).sum().backward()
    torch.testing.assert_close(engine.model.inp.weight.grad, model0.inp.weight.grad, rtol=2e-2, atol=1e-3)
    # negative control: a still-scaled gradient would be 2**10 times larger
    assert not torch.allclose(engine.model.inp.weight.grad, model0.inp.weight.grad * 2**10, rtol=0.5)


def test_float16_scaler_skips_an_overflowing_step_without_raising():
    # with a scaler, inf gradients are the scaler's business: it skips the step and lowers the scale
    state = {"poison": False}

    def get_model(**_kwargs):
        model = TinyModel(dropout=0.0)
        model.out.bias.register_hook(lambda g: torch.full_like(g, math.inf) if state["poison"] else g)
        return model

    engine = make_engine(torch_amp="float16", grad_scaler={"init_scale": 2.0**8}, get_model=get_model)
    engine.train_step()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    state["poison"] = True
    engine.train_step()
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    assert engine.compute.grad_scaler.get_scale() == 2.0**7
