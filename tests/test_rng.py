"""Snapshots of the global RNGs: exact, and cheap when numpy's generator has not moved."""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

from kit import rng


def draws() -> tuple:
    return float(torch.rand(())), float(np.random.rand()), float(np.random.standard_normal()), random.random()


def test_numpy_state_is_reused_only_while_the_generator_has_not_moved():
    np.random.seed(1)
    first = rng.numpy_state()
    assert rng.numpy_state(like=first) is first
    np.random.rand()
    moved = rng.numpy_state(like=first)
    assert moved is not first
    assert moved.state["state"]["pos"] != first.state["state"]["pos"]


def test_a_cached_gaussian_is_never_taken_for_unchanged():
    np.random.seed(1)
    np.random.standard_normal()  # a pair drawn, its second value cached: the words stay as they are
    cached = rng.numpy_state()
    assert cached.state["has_gauss"] == 1
    np.random.standard_normal()  # the cached one: the words do not move, the state does
    now = rng.numpy_state(like=cached)
    assert now is not cached and now.state["has_gauss"] == 0


def test_restore_with_now_puts_back_exactly_what_was_saved():
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    np.random.standard_normal()
    saved = rng.snapshot()
    want = draws()
    for _ in range(3):  # the saved state back after draws, also when "now" is reused from it
        now = rng.snapshot(like=saved)
        rng.restore(saved, now=now)
        assert draws() == want
        rng.restore(saved, now=rng.snapshot(like=saved))
    rng.restore(saved)
    assert draws() == want


def test_the_raw_words_are_numpys_own_state():
    np.random.seed(5)
    np.random.rand(7)
    got = rng.numpy_state()
    assert got.raw is not None  # numpy's MT19937 layout as read: the fast path is on
    key, pos = got.state["state"]["key"], got.state["state"]["pos"]
    assert got.raw[: key.nbytes] == key.tobytes() and int.from_bytes(got.raw[key.nbytes:], sys.byteorder) == pos


def test_numpy_state_put_back_by_moving_the_words_draws_exactly_as_set_state():
    np.random.seed(2)
    saved = rng.numpy_state()
    want = [np.random.rand(), np.random.standard_normal(), np.random.standard_normal(), np.random.randint(9)]
    np.random.seed(11)
    np.random.rand(3)
    now = rng.numpy_state()  # no cached Gaussian on either side: the fast move
    rng.set_numpy_state(saved, now)
    assert [np.random.rand(), np.random.standard_normal(), np.random.standard_normal(), np.random.randint(9)] == want
    # with a cached Gaussian now, numpy's own set_state drops it
    np.random.standard_normal()
    rng.set_numpy_state(saved, rng.numpy_state())
    assert [np.random.rand(), np.random.standard_normal(), np.random.standard_normal(), np.random.randint(9)] == want


def py_draws() -> list[float]:
    return [random.random(), random.gauss(0, 1), random.gauss(0, 1), random.getrandbits(70)]


def test_python_state_is_reused_only_while_the_generator_has_not_moved():
    random.seed(1)
    first = rng.python_state()
    assert first.raw is not None  # CPython's layout confirmed: the fast path is on
    assert rng.python_state(like=first) is first
    random.random()
    moved = rng.python_state(like=first)
    assert moved is not first and moved.state == random.getstate()


def test_python_raw_words_are_the_index_then_the_words_of_getstate():
    random.seed(4)
    random.random()
    got = rng.python_state()
    internal = random.getstate()[1]
    assert got.raw == np.array(internal[-1:], np.int32).tobytes() + np.array(internal[:-1], np.uint32).tobytes()


def test_a_cached_python_gaussian_is_never_taken_for_unchanged():
    random.seed(2)
    random.gauss(0, 1)  # a pair drawn, the second cached in gauss_next: the words stay as they are
    cached = rng.python_state()
    assert cached.state[2] is not None
    random.gauss(0, 1)  # the cached one: words unchanged, state changed
    now = rng.python_state(like=cached)
    assert now is not cached and now.state[2] is None


def test_python_state_put_back_by_moving_the_words_draws_exactly_as_setstate():
    random.seed(6)
    saved = rng.python_state()
    want = py_draws()
    random.seed(12)
    random.random()
    rng.set_python_state(saved, rng.python_state())  # no cached Gaussian on either side: the move
    assert py_draws() == want
    random.gauss(0, 1)  # a cached Gaussian now: random.setstate drops it
    rng.set_python_state(saved, rng.python_state())
    assert py_draws() == want


def test_a_patched_random_getstate_falls_back_to_the_full_state(monkeypatch):
    random.seed(8)
    saved = rng.snapshot()
    want = draws()
    original = random.getstate
    monkeypatch.setattr(random, "getstate", lambda: original())  # a plain function: no instance behind it
    state = rng.python_state()
    assert state.words is None
    rng.restore(saved, now=rng.snapshot(like=saved))
    assert draws() == want
