"""RETURNN's ``default_float_dtype``: the model, the batches' float tensors and torch's default dtype
inside every step (train, eval, forward) in that dtype; torch's default as before outside a step.
Bit-equality with RETURNN itself is ``tests/returnn_compat/test_round_trip.py`` (variant float64)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.models import tiny_config
from helpers.models import train_step as tiny_train_step

import kit
from kit.engine.engine import Engine


def seen_by_steps(seen: list[dict[str, Any]]):
    """A train and a forward step that note what they see, then do the usual work."""

    def note(model: torch.nn.Module, extern_data: kit.Batch, stage: str) -> None:
        seen.append({
            "stage": stage,
            "data": extern_data["data"].tensor.dtype,
            "classes": extern_data["classes"].tensor.dtype if "classes" in extern_data else None,
            "default": torch.get_default_dtype(),
            "params": {p.dtype for p in model.parameters()},
        })

    def train_step(*, model: torch.nn.Module, extern_data: kit.Batch, **kwargs: Any) -> None:
        note(model, extern_data, "train" if model.training else "eval")
        tiny_train_step(model=model, extern_data=extern_data, **kwargs)

    def forward_step(*, model: torch.nn.Module, extern_data: kit.Batch, **_: Any) -> None:
        note(model, extern_data, "forward")
        kit.get_run_ctx().mark_as_output(model(extern_data["data"].tensor), "logits",
                                         lengths=extern_data["data"].lengths)

    return train_step, forward_step


# forward's outputs are numpy arrays per sequence: bfloat16 (which numpy lacks) comes back as float32
@pytest.mark.parametrize("name, dtype, output", [("float64", torch.float64, "float64"),
                                                 ("bfloat16", torch.bfloat16, "float32")])
def test_every_step_runs_in_the_dtype_and_the_default_is_back_after(tmp_path, name, dtype, output):
    seen: list[dict[str, Any]] = []
    train_step, forward_step = seen_by_steps(seen)
    engine = Engine(kit.Config(tiny_config(str(tmp_path / "model"), num_epochs=1, default_float_dtype=name,
                                           train_step=train_step, forward_step=forward_step)))
    engine.train()
    outputs = engine.forward(engine.datasets["dev"])
    assert torch.get_default_dtype() == torch.float32  # outside the steps, as before
    assert {s["stage"] for s in seen} == {"train", "eval", "forward"}
    for s in seen:
        assert (s["data"], s["default"], s["params"]) == (dtype, dtype, {dtype}), s
        assert s["classes"] in (None, torch.int64), s  # labels keep their dtype
    assert {str(v["logits"].dtype) for v in outputs.values()} == {output}
    assert all(p.dtype == dtype for p in engine.model.parameters())


def test_a_run_resumed_in_float64_goes_on_in_float64(tmp_path):
    config = tiny_config(str(tmp_path / "model"), num_epochs=1, default_float_dtype="float64")
    Engine(kit.Config(config)).train()
    resumed = Engine(kit.Config({**config, "num_epochs": 2}))
    resumed.train()
    assert resumed.progress.epoch == 3
    assert {p.dtype for p in resumed.model.parameters()} == {torch.float64}
    state = resumed.optimizer.state
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float64}


def test_without_the_key_nothing_changes(tmp_path):
    seen: list[dict[str, Any]] = []
    train_step, forward_step = seen_by_steps(seen)
    Engine(kit.Config(tiny_config(num_epochs=1, train_step=train_step, forward_step=forward_step))).train()
    assert {(s["data"], s["default"]) for s in seen} == {(torch.float32, torch.float32)}


def test_an_unknown_dtype_is_a_config_error_naming_the_key():
    with pytest.raises(kit.ConfigError, match="default_float_dtype"):
        Engine(kit.Config(tiny_config(num_epochs=1, default_float_dtype="double"))).setup()
