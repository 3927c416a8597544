"""A session's world: torch's default device read without torch's slow function, answering the same."""

from __future__ import annotations

import torch

from kit.session.world import default_device


def test_default_device_answers_as_torch_does_with_and_without_a_default_set():
    try:
        assert default_device() == torch.get_default_device() == torch.device("cpu")
        torch.set_default_device("meta")
        assert default_device() == torch.get_default_device() == torch.device("meta")
        with torch.device("cpu"):  # a device context inside the default: the innermost counts
            assert default_device() == torch.get_default_device() == torch.device("cpu")
        torch.set_default_device(None)
        with torch.device("meta"):
            assert default_device() == torch.get_default_device() == torch.device("meta")
        assert default_device() == torch.device("cpu")
    finally:
        torch.set_default_device(None)
