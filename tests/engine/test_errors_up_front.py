"""Mistakes that today surface late or raw, said up front with the key's name (issue 11, items 15-18)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_config

import kit
from kit.data import ArrayDataset
from kit.engine.engine import Engine
from kit.run_ctx import LossError

# ---- 15: optimizer keywords against the optimizer's signature, at set-up ----------------------------


@pytest.mark.parametrize("optimizer, expected", [
    ({"class": "adam", "betas": 0.9}, r"betas=0.9 for Adam, expected a tuple of 2 numbers"),
    ({"class": "sgd", "momentum": "0.9"}, r"momentum='0.9' for SGD, expected a number"),
    ({"class": "adam", "amsgrad": 1}, r"amsgrad=1 for Adam, expected True or False"),
    ({"class": "adam", "beta": (0.9, 0.99)}, r"Adam does not accept 'beta'"),
    ({"class": "adamx"}, r"unknown optimizer class 'adamx'"),
])
def test_bad_optimizer_settings_are_one_config_error_at_set_up(tmp_path, optimizer, expected):
    engine = Engine(kit.Config(tiny_config(str(tmp_path / "model"), optimizer=optimizer)))
    with pytest.raises(kit.ConfigError, match=r"config key 'optimizer': .*" + expected):
        engine.setup()
    assert engine.model is None  # before the model and data were built


def test_every_bad_optimizer_value_is_named_at_once(tmp_path):
    engine = Engine(kit.Config(tiny_config(optimizer={"class": "sgd", "momentum": "0.9", "nesterov": "yes",
                                                      "betas": (0.9, 0.99)})))
    with pytest.raises(kit.ConfigError) as info:
        engine.setup()
    assert len(info.value.problems) == 3 and all("'optimizer'" in p for p in info.value.problems)


def test_torchs_own_range_checks_name_the_optimizer_key():
    engine = Engine(kit.Config(tiny_config(optimizer={"class": "adam", "betas": (0.9, 1.5)})))
    with pytest.raises(kit.ConfigError, match=r"config key 'optimizer': Adam refused .*beta"):
        engine.train_step()


def test_good_optimizer_settings_pass():  # negative control
    engine = Engine(kit.Config(tiny_config(optimizer={"class": "adamw", "betas": [0.9, 0.98], "eps": 1e-8,
                                                      "weight_decay": 0.01, "amsgrad": True})))
    assert engine.train_step() is not None


# ---- 17: no output, no loss -------------------------------------------------------------------------


def test_a_forward_step_that_marks_no_output_is_an_error_naming_forward_step():
    def forward_step(*, model, extern_data, **_):
        return model(extern_data["data"].tensor)

    engine = Engine(kit.Config(tiny_config(forward_step=forward_step)))
    with pytest.raises(kit.DataError, match=r"forward_step marked no output .*mark_as_output\(") as info:
        engine.forward(kit.data.Task12AXDataset(3, seed=1))
    assert "ignores return values" in str(info.value)


def test_a_train_step_that_returns_its_loss_is_told_kit_ignores_return_values():
    def train_step(*, model, extern_data, **_):
        logits = model(extern_data["data"].tensor)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), extern_data["classes"].tensor)

    engine = Engine(kit.Config(tiny_config(train_step=train_step)))
    with pytest.raises(LossError) as info:
        engine.train_step()
    text = str(info.value)
    assert "train_step marked no loss" in text and "ignores return values" in text
    assert 'mark_as_loss(loss, "loss")' in text and "(none)" not in text


def test_a_train_step_that_marks_nothing_says_no_loss_was_marked():
    engine = Engine(kit.Config(tiny_config(train_step=lambda **_: None)))
    with pytest.raises(LossError, match="train_step marked no loss") as info:
        engine.train_step()
    assert "ignores return values" not in str(info.value)


# ---- 18: tuple sequences ----------------------------------------------------------------------------


def test_a_tuple_sequence_gets_the_fix_in_the_message():
    import numpy as np

    pair = (np.zeros((3, 9), "float32"), np.zeros((3,), "int64"))
    with pytest.raises(kit.DataError, match=r'got tuple; .*return \{"data": x, "classes": y\}'):
        ArrayDataset([pair, pair])
    # a torch dataset of (x, y) pairs, the usual PyTorch habit
    pairs = torch.utils.data.TensorDataset(torch.zeros(4, 3, 9), torch.zeros(4, 3, dtype=torch.long))
    engine = Engine(kit.Config(tiny_config(train=kit.data.from_torch_dataset(pairs))))
    with pytest.raises(kit.DataError, match=r'return \{"data": x, "classes": y\}'):
        engine.train_step()
