"""Two sessions in one process never interfere: stepped in turns, each equals itself run alone."""

from __future__ import annotations

import contextlib
import functools
import random

import numpy as np
import torch
from helpers.models import TinyModel, tiny_config
from helpers.models import train_step as tiny_train_step
from session_testlib import LossRecorder, state, states_equal

import kit
from kit.session import Session
from kit.session.parts import SessionParts


def noisy_train_step(*, model, extern_data, **kwargs):
    """The tiny step plus a loss term scaled by numpy and python random draws (user-code randomness)."""
    tiny_train_step(model=model, extern_data=extern_data, **kwargs)
    # a legacy Gaussian each step: numpy's cached second one is part of the state that must not leak
    scale = 1.0 + np.random.rand() + random.random() + 0.01 * np.random.standard_normal()
    kit.get_run_ctx().mark_as_loss(model.out.bias.square().sum() * scale, "noise")


CONFIG_A = dict(train_step=noisy_train_step, num_epochs=2)
CONFIG_B = dict(train_step=noisy_train_step, num_epochs=2, random_seed=7, learning_rate=0.02, max_seqs=6)
CONFIGS = {"a": CONFIG_A, "b": CONFIG_B}


def run(session: Session, calls: list) -> None:
    for call in calls:
        call(session)


@functools.cache
def alone(which: str) -> tuple[dict, torch.Tensor]:
    rec = LossRecorder()
    with kit.Session(**tiny_config(**CONFIGS[which])) as s:
        s.on("step_end", rec)
        s.train()
        return state(s.model), rec.stacked()


def interleaved() -> list[tuple[dict, torch.Tensor]]:
    sessions, recorders = [], []
    for config in (CONFIG_A, CONFIG_B):
        recorders.append(LossRecorder())
        sessions.append(kit.Session(**tiny_config(**config)))
        sessions[-1].on("step_end", recorders[-1])
    a, b = sessions
    for _ in range(3):
        a.train_step()
        b.train_step()
    a.train_steps(5)
    b.train_epoch()
    a.train_epoch()
    b.eval()
    b.train_steps(4)
    a.forward(["seq-1"], dataset="dev")
    a.train_step()
    b.train()
    a.train()
    out = [(state(s.model), r.stacked()) for s, r in zip(sessions, recorders)]
    for s in sessions:
        s.close()
    return out


def test_two_sessions_stepped_in_turns_each_equal_their_run_alone():
    expected = [alone("a"), alone("b")]
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    got = interleaved()
    for (want_state, want_losses), (got_state, got_losses) in zip(expected, got):
        assert states_equal(got_state, want_state)
        assert torch.equal(got_losses, want_losses)
    # the caller's own random streams are untouched by the sessions' work
    draws = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    assert draws == (torch.rand(1), np.random.rand(), random.random())


def test_negative_control_without_swapping_rng_states_the_sessions_interfere(monkeypatch):
    expected = [alone("a"), alone("b")]
    monkeypatch.setattr(SessionParts, "entered", lambda self: contextlib.nullcontext())
    got = interleaved()
    assert not all(states_equal(g[0], e[0]) for g, e in zip(got, expected))
    assert not all(torch.equal(g[1], e[1]) for g, e in zip(got, expected))


def test_a_default_dtype_set_in_one_sessions_user_code_stays_in_that_session():
    seen: dict[str, list] = {"a": [], "b": []}

    def recording(name):
        def train_step(**kwargs):
            seen[name].append(torch.get_default_dtype())
            tiny_train_step(**kwargs)

        return train_step

    def get_model(**_kwargs):
        torch.set_default_dtype(torch.float64)  # user code changing a torch default
        return TinyModel().float()

    try:
        a = kit.Session(**tiny_config(get_model=get_model, train_step=recording("a")))
        b = kit.Session(**tiny_config(train_step=recording("b")))
        a.train_step()
        assert torch.get_default_dtype() == torch.float32
        b.train_step()
        a.train_step()
        assert seen == {"a": [torch.float64, torch.float64], "b": [torch.float32]}
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_callers_cached_gaussian_and_numpy_stream_survive_a_sessions_calls():
    np.random.seed(3)
    want = [np.random.standard_normal() for _ in range(4)]
    np.random.seed(3)
    got = [np.random.standard_normal()]  # numpy now holds the pair's second value
    with kit.Session(**tiny_config(**CONFIG_A)) as s:
        s.train_step()
        got.append(np.random.standard_normal())  # the cached one
        s.train_steps(2)
        s.train_step()
        got += [np.random.standard_normal(), np.random.standard_normal()]
    assert got == want


def test_the_callers_python_stream_and_cached_gaussian_survive_a_sessions_calls():
    random.seed(3)
    want = [random.gauss(0, 1), random.gauss(0, 1), random.random(), random.gauss(0, 1)]
    random.seed(3)
    got = [random.gauss(0, 1)]  # random now caches the pair's second value in gauss_next
    with kit.Session(**tiny_config(**CONFIG_A)) as s:
        s.train_step()
        got.append(random.gauss(0, 1))  # the cached one
        s.train_steps(2)
        got.append(random.random())
        s.train_step()
        got.append(random.gauss(0, 1))
    assert got == want


def test_a_blocking_train_call_swaps_the_sessions_world_once(monkeypatch):
    from kit.session import world

    swaps = []
    original = world.torch_defaults

    def counted():  # read twice per swap: the caller's defaults going in, the session's coming out
        swaps.append(1)
        return original()

    with kit.Session(**tiny_config(**CONFIG_A)) as s:
        s.train_step()  # set-up (model, optimizer, pipeline) done
        monkeypatch.setattr(world, "torch_defaults", counted)
        for call in (s.train_step, lambda: s.train_steps(3), s.train_epoch):
            swaps.clear()
            call()
            assert len(swaps) == 2  # one swap in and out; ~0.05 ms each: set-up checks and the steps share one
