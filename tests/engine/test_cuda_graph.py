"""``torch_cuda_graph``: RETURNN's options and limits as config errors, the bounds, and on the CPU the
Inductor-compiled step (``compile``, ``capture=False``) against the eager one, with the eager replay of
a failing compiled step. The CUDA capture is checked by ``benchmarks/gpu_check.py`` (case ``cuda_graph``).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers.models import TinyModel, tiny_config

import kit
from kit.engine.cuda_graph import GraphOptions
from kit.engine.engine import Engine

BOUNDS = {"batch_size_bound": 10, "dim_capacity": {"data": 300, "classes": 300}}
TOLERANCE = 1e-5  # relative, per step loss: Inductor fuses and reorders float32 sums


def no_dropout_model(*, epoch, step, **_kwargs):
    return TinyModel(dropout=0.0)


def nan_at_step(k: int):
    """The tiny step whose loss turns NaN at global step ``k`` (the step as a tensor: a graph input)."""

    def train_step(*, model, extern_data, **_kwargs):
        data, classes = extern_data["data"], extern_data["classes"]
        logits = model(data.tensor)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
        poison = torch.where(torch.as_tensor(kit.get_run_ctx().step) == k, math.nan, 0.0)
        kit.get_run_ctx().mark_as_loss(ce + poison, "ce", mask=classes.mask())

    return train_step


def engine(**overrides) -> Engine:
    overrides.setdefault("get_model", no_dropout_model)
    return Engine(kit.Config(tiny_config(None, device="cpu", **overrides)))


# ---- options --------------------------------------------------------------------------------


def test_options_take_returnn_defaults():
    opts = GraphOptions.parse({"batch_size_bound": 4, "dim_capacity": {"data": 9}})
    assert (opts.warmup_steps, opts.capture_optimizer, opts.compile, opts.capture, opts.mask_padding_seqs) == (
        0, False, False, True, True)


@pytest.mark.parametrize("value, says", [
    ({"dim_capacity": {}}, "batch_size_bound"),
    ({"batch_size_bound": 4, "capture": False}, "'capture': False requires 'compile': True"),
    ({"batch_size_bound": 4, "captur": True}, "unknown option(s) ['captur']"),
    ({"batch_size_bound": 4, "dim_capacity": {"data": 0}}, "dim_capacity"),
    ({"batch_size_bound": 4, "compile": "yes"}, "'compile' must be True or False"),
    ([4], "expected a dict"),
])
def test_a_wrong_value_is_a_config_error_naming_the_key(value, says):
    with pytest.raises(kit.ConfigError, match="torch_cuda_graph") as info:
        kit.Config({"torch_cuda_graph": value})
    assert says in str(info.value)


def test_returnn_only_options_are_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kit"):
        GraphOptions.parse({"batch_size_bound": 4, "partitioned": True})
    assert "partitioned" in caplog.text and "ignored" in caplog.text


def test_capture_on_a_cpu_device_is_a_config_error_naming_the_key():
    e = engine(torch_cuda_graph=dict(BOUNDS))
    with pytest.raises(kit.ConfigError, match="'torch_cuda_graph': 'capture' .* needs a CUDA device"):
        e.train_step()
    control = engine(torch_cuda_graph={**BOUNDS, "compile": True, "capture": False})  # no capture: accepted
    assert control.training and control.config.typed_value("torch_cuda_graph")["capture"] is False


@pytest.mark.parametrize("overrides, says", [
    ({"accum_grad_multiple_step": 2}, "gradient accumulation"),
    ({"torch_amp": "float16", "grad_scaler": {}}, "GradScaler"),
])
def test_returnn_limits_are_config_errors(overrides, says):
    e = engine(torch_cuda_graph={**BOUNDS, "compile": True, "capture": False}, **overrides)
    with pytest.raises(kit.ConfigError, match=says):
        e.train_step()


def test_warmup_steps_run_eagerly_and_a_batch_beyond_the_bounds_is_named():
    small = {"batch_size_bound": 2, "dim_capacity": {"data": 300, "classes": 300}, "compile": True, "capture": False,
             "warmup_steps": 1}
    e = engine(torch_cuda_graph=small)
    assert e.train_step() is not None  # the eager warm-up step: no bounds yet
    with pytest.raises(kit.DataError, match="exceeds batch_size_bound=2"):
        e.train_step()


def test_a_time_axis_needs_its_dim_capacity():
    e = engine(torch_cuda_graph={"batch_size_bound": 10, "dim_capacity": {"data": 300}, "compile": True,
                                 "capture": False})
    with pytest.raises(kit.ConfigError, match="'dim_capacity' needs an entry for data key 'classes'"):
        e.train_step()


# ---- the compiled step on the CPU -------------------------------------------------------------------


def steps_of(session: kit.Session) -> list[dict[str, float]]:
    seen: list[dict[str, float]] = []
    session.engine.events.on("step_end", lambda result: seen.append(result.losses))
    return seen


@pytest.mark.slow  # one Inductor compile (C++ on the CPU): ~15 s warm, over a minute with a cold cache
def test_compiled_step_trains_as_the_eager_one_and_a_failing_step_replays_eagerly(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU compile path; CUDA runs benchmarks/gpu_check.py")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled_calls: list[object] = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_calls.append(fn) or real_compile(fn, **kw))
    k = 5  # the poisoned step
    cfg = tiny_config(None, device="cpu", get_model=no_dropout_model, train_step=nan_at_step(k))
    eager = kit.Session(cfg, live=False)
    eager_losses = steps_of(eager)
    with pytest.raises(kit.NonFiniteLossError):
        eager.train_epoch()
    graphed = kit.Session({**cfg, "torch_cuda_graph": {**BOUNDS, "compile": True, "capture": False,
                                                       "warmup_steps": 1}}, live=False)
    graphed_losses = steps_of(graphed)
    with pytest.raises(kit.NonFiniteLossError):
        graphed.train_epoch()
    assert len(compiled_calls) == 1  # the compiled path ran (steps 1.., after one eager warm-up step)
    assert len(graphed_losses) == len(eager_losses) == k  # the good steps; the bad one raised in both
    for e, g in zip(eager_losses, graphed_losses):
        assert g["ce"] == pytest.approx(e["ce"], rel=TOLERANCE)
    for (name, pe), pg in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(pg, pe, rtol=1e-4, atol=1e-6, msg=name)  # k - 1 Adam updates apart at most
    # the failing compiled step, replayed eagerly (the user's step, the real batch, not the compiled one)
    ctx = graphed.last_failure
    assert ctx is not None and ctx.global_train_step == k
    assert ctx.batch.num_seqs <= BOUNDS["batch_size_bound"] and ctx.batch["data"].tensor.shape[0] == ctx.batch.num_seqs
    calls_before = len(compiled_calls)
    report = graphed.replay()
    assert report.reproduced and "loss ce" in report.nonfinite
    assert len(compiled_calls) == calls_before
    eager.close()
    graphed.close()
