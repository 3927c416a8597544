"""Errors from user code and from config mistakes: the type is kept, the message says where.

User exceptions get the module call stack (``(Module.method) path.to.module``) and a batch
summary; user callables without ``**kwargs`` and missing pieces are one clear ConfigError.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import TinyModel, forward_step, tiny_config
from helpers.models import train_step as tiny_train_step

import kit
from kit.data import Batch, Field, Task12AXDataset
from kit.engine.engine import Engine
from kit.run_ctx import LossError


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(9, 2)

    def forward(self, x):
        if not self.training or x.shape[0] > 0:
            raise ValueError("bad value inside Inner")
        return self.lin(x)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def make_engine(**overrides) -> Engine:
    return Engine(kit.Config(tiny_config(None, **overrides)))


STACK = ["(Net.forward) (root)", "(Block.forward) block", "(Inner.forward) block.inner"]


def _assert_annotated(exc: BaseException, stage: str) -> None:
    text = str(exc)
    assert text.startswith("bad value inside Inner")  # the user's message comes first
    assert f"during {stage}" in text
    positions = [text.index(line) for line in STACK]
    assert positions == sorted(positions)  # outermost module first
    assert "batch of " in text and "data: shape (" in text and "torch.float32" in text
    assert "classes: shape (" in text and "min 0, max 1" in text


def test_exception_in_train_step_keeps_its_type_and_names_the_modules():
    engine = make_engine(get_model=lambda **_: Net())
    with pytest.raises(ValueError) as info:
        engine.train_step()
    _assert_annotated(info.value, "train")
    assert engine.progress.global_train_step == 0


def test_exception_in_eval_is_annotated_too():
    engine = make_engine(get_model=lambda **_: Net())
    with pytest.raises(ValueError) as info:
        engine.eval_model()
    _assert_annotated(info.value, "eval of 'dev'")


def test_exception_in_forward_is_annotated_too():
    engine = make_engine(get_model=lambda **_: Net())
    with pytest.raises(ValueError) as info:
        engine.forward(Task12AXDataset(3))
    _assert_annotated(info.value, "forward")


def test_key_error_from_user_code_keeps_its_message_and_gets_a_note():
    def train_step(*, model, extern_data, **_kwargs):
        extern_data["no_such_key"]

    engine = make_engine(train_step=train_step)
    with pytest.raises(KeyError) as info:
        engine.train_step()
    assert "no_such_key" in str(info.value)
    assert any("batch of " in note for note in info.value.__notes__)


def test_batch_summary_reports_out_of_range_labels():
    labels = torch.tensor([[0, 1, 5], [1, -1, 0]])
    batch = Batch(
        {"classes": Field(labels, torch.tensor([3, 2], dtype=torch.int32), sparse_dim=2)}, seq_tags=["a", "b"]
    )
    summary = batch.summary()
    assert "batch of 2 seqs" in summary and "'a', 'b'" in summary
    assert "2 labels outside [0, 2)" in summary and "lengths 2..3" in summary


# ---- user callables must take **kwargs ------------------------------------------------------


def _no_kwargs_get_model(*, epoch, step):
    return TinyModel()


def _no_kwargs_train_step(*, model, extern_data):
    tiny_train_step(model=model, extern_data=extern_data)


def _no_kwargs_forward_step(*, model, extern_data):
    forward_step(model=model, extern_data=extern_data)


@pytest.mark.parametrize(
    "key, value, action",
    [
        ("get_model", _no_kwargs_get_model, "setup"),
        ("train_step", _no_kwargs_train_step, "train_step"),
        ("train_step", _no_kwargs_train_step, "eval_model"),
        ("forward_step", _no_kwargs_forward_step, "forward"),
        (
            "dynamic_learning_rate",
            lambda *, global_train_step, epoch, epoch_continuous, learning_rate: learning_rate,
            "train_step",
        ),
    ],
)
def test_user_callable_without_kwargs_is_a_config_error_that_says_so(key, value, action):
    engine = make_engine(**{key: value})
    args = (Task12AXDataset(2),) if action == "forward" else ()
    with pytest.raises(kit.ConfigError) as info:
        getattr(engine, action)(*args)
    assert key in str(info.value) and "**kwargs" in str(info.value)


# ---- missing pieces and misuse ----------------------------------------------------------------


@pytest.mark.parametrize(
    "key, action, expected",
    [
        ("get_model", "setup", "'get_model' is not set"),
        ("train_step", "train_step", "'train_step' is not set"),
        ("forward_step", "forward", "'forward_step' is not set"),
        ("train", "train_step", "'train' is not set"),
        ("optimizer", "train_step", "'optimizer' is not set"),
    ],
)
def test_missing_pieces_are_named(key, action, expected):
    engine = make_engine(**{key: None})
    args = (Task12AXDataset(2),) if action == "forward" else ()
    with pytest.raises(kit.ConfigError, match=expected):
        getattr(engine, action)(*args)


def test_get_model_returning_no_module_is_a_config_error():
    engine = make_engine(get_model=lambda **_: "a string")
    with pytest.raises(kit.ConfigError, match="returned str, expected a torch.nn.Module"):
        engine.setup()


def test_only_error_losses_in_training_is_a_clear_error():
    def train_step(*, model, extern_data, **_kwargs):
        logits = model(extern_data["data"].tensor)
        kit.get_run_ctx().mark_as_loss((logits.argmax(-1) == 0).float(), "fer", as_error=True)

    engine = make_engine(train_step=train_step)
    with pytest.raises(LossError, match=r"only error losses.*fer.*train_step"):
        engine.train_step()


def test_marking_a_loss_name_twice_is_a_clear_error():
    def train_step(*, model, extern_data, **_kwargs):
        out = model(extern_data["data"].tensor)
        kit.get_run_ctx().mark_as_loss(out, "ce")
        kit.get_run_ctx().mark_as_loss(out, "ce")

    engine = make_engine(train_step=train_step)
    with pytest.raises(LossError, match="'ce' was already marked"):
        engine.train_step()


def test_finish_epoch_when_none_is_running_is_a_clear_error():
    engine = make_engine()
    with pytest.raises(kit.KitError, match="no epoch is running"):
        engine.finish_epoch()


def test_exception_event_is_emitted_with_the_stage():
    engine = make_engine(get_model=lambda **_: Net())
    seen = []
    engine.events.on(
        "exception", lambda error, stage, batch: seen.append((type(error), stage, batch.num_seqs))
    )
    with pytest.raises(ValueError):
        engine.train_step()
    assert seen and seen[0][:2] == (ValueError, "train") and seen[0][2] > 0
