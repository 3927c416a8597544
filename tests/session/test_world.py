"""A session's world: its RNG states and torch defaults swapped in around its work, through torch's public API."""

from __future__ import annotations

import random

import numpy as np
import torch

from kit.session.world import World, torch_defaults


def test_the_default_device_is_read_and_put_back_as_torch_answers():
    world = World()
    try:
        with world.entered():
            torch.set_default_device("meta")  # the session's own default device
        assert torch.get_default_device() == torch.device("cpu")  # the caller's again
        with world.entered():
            assert torch.get_default_device() == torch.device("meta")
            assert torch_defaults()[1] == torch.device("meta")
        with torch.device("meta"):  # a caller's device context stays the caller's
            assert torch_defaults()[1] == torch.device("meta")
    finally:
        torch.set_default_device(None)


def test_the_worlds_draws_continue_where_they_stopped_and_the_callers_too():
    world = World()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    with world.entered():
        torch.manual_seed(7), np.random.seed(7), random.seed(7)
        inside = (float(torch.rand(())), float(np.random.rand()), random.random())
    outside = (float(torch.rand(())), float(np.random.rand()), random.random())
    with world.entered():
        second = (float(torch.rand(())), float(np.random.rand()), random.random())
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected_inside = [(float(torch.rand(())), float(np.random.rand()), random.random()) for _ in range(2)]
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    assert (inside, second) == tuple(expected_inside)
    assert outside == (float(torch.rand(())), float(np.random.rand()), random.random())
