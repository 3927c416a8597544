"""A session's world: its RNG states and torch defaults (dtype, device), swapped in around its work.

A session starts from the caller's state at its first use; from then on user code of one
session (``torch.set_default_dtype`` in ``get_model``, say) never reaches another, and two
sessions stepped in turns in one kernel each get exactly what they would get alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kit.rng import RngState

TorchDefaults = tuple[torch.dtype, torch.device]


class World:
    """The RNG states and torch defaults of one session between its calls."""

    def __init__(self) -> None:
        self.rng: RngState | None = None  # None: not entered yet (the caller's state is the start)
        self.defaults: TorchDefaults | None = None
        self.depth = 0  # entered blocks now: inside one (a view asking from a step_end handler) nothing swaps

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """This world's state in, the caller's back afterwards (also when the block raises);
        inside an entered block, nothing (a train call enters several times)."""
        if self.depth:
            yield
            return
        self.depth += 1
        try:
            outer, outer_defaults = RngState.capture(), torch_defaults()
            if self.rng is not None:
                self.rng.restore()
            if self.defaults is not None:
                set_torch_defaults(self.defaults, outer_defaults)
            try:
                yield
            finally:
                self.rng, self.defaults = RngState.capture(), torch_defaults()
                outer.restore()
                set_torch_defaults(outer_defaults, self.defaults)
        finally:
            self.depth -= 1


def torch_defaults() -> TorchDefaults:
    return torch.get_default_dtype(), torch.get_default_device()


def set_torch_defaults(wanted: TorchDefaults, now: TorchDefaults) -> None:
    """Change only what differs: a default device is a global torch function mode (a cost on every op),
    so "cpu" is set as no default device at all."""
    if wanted[0] != now[0]:
        torch.set_default_dtype(wanted[0])
    if wanted[1] != now[1]:
        torch.set_default_device(None if wanted[1] == torch.device("cpu") else wanted[1])
