"""A session's world: its RNG states and torch defaults (dtype, device), swapped in around its work.

A session starts from the caller's state at its first use; from then on user code of one
session (``torch.set_default_dtype`` in ``get_model``, say) never reaches another, and two
sessions stepped in turns in one kernel each get exactly what they would get alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kit import rng

TorchDefaults = tuple[torch.dtype, torch.device]
_NOTHING = contextlib.nullcontext()  # stateless: one serves every nested entry of every world


class World:
    """The RNG states and torch defaults of one session between its calls."""

    def __init__(self) -> None:
        self.rng: tuple | None = None  # None: not entered yet (the caller's state is the start)
        self.defaults: TorchDefaults | None = None
        self.outer: tuple | None = None  # the caller's state put back when the last block ended
        self.depth = 0  # entered blocks now: inside one (a view asking from a step_end handler) nothing swaps

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """This world's state in, the caller's back afterwards (also when the block raises);
        inside an entered block, nothing (one shared no-op: a train call enters several times)."""
        return _NOTHING if self.depth else self._outermost()

    @contextlib.contextmanager
    def _outermost(self) -> Iterator[None]:
        self.depth += 1
        try:
            # each snapshot is compared with the one the state may still equal (numpy's and python's
            # parts are then reused, and written back only where they differ)
            outer, outer_defaults = rng.snapshot(like=self.outer), torch_defaults()
            if self.rng is not None:
                rng.restore(self.rng, now=outer)
            if self.defaults is not None:
                set_torch_defaults(self.defaults, outer_defaults)
            try:
                yield
            finally:
                self.rng, self.defaults = rng.snapshot(like=self.rng or outer), torch_defaults()
                rng.restore(outer, now=self.rng)
                self.outer = outer
                set_torch_defaults(outer_defaults, self.defaults)
        finally:
            self.depth -= 1


def torch_defaults() -> TorchDefaults:
    return torch.get_default_dtype(), default_device()


_CPU = torch.device("cpu")
# where a default device would be (looked up once; None in a torch without them: then torch is asked)
_function_stack_len = getattr(torch._C, "_len_torch_function_stack", None)
_device_context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)  # torch's thread-local


def default_device() -> torch.device:
    """``torch.get_default_device()``, answered without it where no default device can be in effect.

    A default device is a ``DeviceContext`` on torch's function-mode stack, or torch's thread-local
    global context; with neither, torch's own answer is "cpu". Its function costs ~40 µs between
    training steps (imports, a closure, a filter over the stack); these two reads cost ~1 µs."""
    if (_function_stack_len is not None and _device_context is not None and _function_stack_len() == 0
            and getattr(_device_context, "device_context", None) is None):
        return _CPU
    return torch.get_default_device()


def set_torch_defaults(wanted: TorchDefaults, now: TorchDefaults) -> None:
    """Change only what differs: a default device is a global torch function mode (a cost on every op),
    so "cpu" is set as no default device at all."""
    if wanted[0] != now[0]:
        torch.set_default_dtype(wanted[0])
    if wanted[1] != now[1]:
        torch.set_default_device(None if wanted[1] == torch.device("cpu") else wanted[1])
