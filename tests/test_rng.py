"""``kit.rng.RngState``: one snapshot type for every global RNG, exact, and a file form that loads safely."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from kit.rng import RngState, get_rng_state, set_rng_state


def draws() -> tuple:
    return float(torch.rand(())), float(np.random.rand()), float(np.random.standard_normal()), random.random(), \
        random.gauss(0, 1)


def test_restore_puts_back_every_generator_exactly():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    draws()  # leaves cached Gaussians behind (numpy's and python's): part of the state
    state = RngState.capture()
    first = draws()
    state.restore()
    assert draws() == first


def test_a_torch_only_snapshot_leaves_numpy_and_python_alone():
    torch.manual_seed(1), np.random.seed(1)
    state = RngState.capture(host=False)
    t, n = float(torch.rand(())), float(np.random.rand())
    state.restore()
    assert float(torch.rand(())) == t and float(np.random.rand()) != n
    assert state.numpy is None and state.python is None


def test_the_file_form_round_trips_through_a_weights_only_load():
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    draws()
    state = RngState.capture()
    buf = io.BytesIO()
    torch.save(state.to_dict(), buf)
    buf.seek(0)
    loaded = RngState.from_dict(torch.load(buf, weights_only=True))
    assert loaded.equals(state)
    first = draws()
    loaded.restore()
    assert draws() == first


def test_get_and_set_rng_state_are_the_file_form():
    np.random.seed(2)
    saved = get_rng_state()
    value = float(np.random.rand())
    set_rng_state(saved)
    assert float(np.random.rand()) == value


def test_equals_tells_states_apart():
    a = RngState.capture()
    torch.rand(3)
    b = RngState.capture()
    assert a.equals(a) and not a.equals(b)


@pytest.mark.parametrize("part", ["numpy", "python"])
def test_equals_compares_every_captured_part(part):
    a = RngState.capture()
    (np.random.rand() if part == "numpy" else random.random())
    assert not a.equals(RngState.capture())
