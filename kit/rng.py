"""Every global RNG a training step may touch (torch, CUDA, numpy, python): one state type, and the seeds.

:class:`RngState` is the one shape an RNG snapshot has in kit — a session's world swap, a
checkpoint, the training-state snapshot, the debugger's step record and the replay all use it.
It is taken and put back through each library's public functions only; its file form
(:meth:`RngState.to_dict`) holds tensors, ints, floats and strings, so checkpoints holding it
load with ``torch.load(weights_only=True)`` and no allow-list.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class RngState:
    """A snapshot of the global RNGs. ``numpy`` / ``python`` are None when only torch's was taken
    (``capture(host=False)``: what a step replay needs); ``cuda`` is None while CUDA is not in use."""

    torch: Tensor
    cuda: tuple[Tensor, ...] | None = None
    numpy: tuple[Any, ...] | None = None  # np.random.get_state() (the legacy tuple)
    python: tuple[Any, ...] | None = None  # random.getstate()

    @classmethod
    def capture(cls, *, host: bool = True) -> RngState:
        """The RNG states now; ``host=False``: torch's (and CUDA's) only."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
        if not host:
            return cls(torch.get_rng_state(), cuda)
        np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]  # a tuple
        return cls(torch.get_rng_state(), cuda, np_state, random.getstate())

    def restore(self) -> None:
        """Put the captured states back (the parts that were captured)."""
        torch.set_rng_state(self.torch)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(self.cuda))
        if self.numpy is not None:
            np.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)

    def equals(self, other: RngState) -> bool:
        """The same states, part by part (a test's and a rewind's check)."""
        return (torch.equal(self.torch, other.torch)
                and _same_tensors(self.cuda, other.cuda)
                and _same_numpy(self.numpy, other.numpy)
                and self.python == other.python)

    # ---- file form ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Tensors, ints, floats and strings only (``torch.load(weights_only=True)`` reads it)."""
        state: dict[str, Any] = {"torch": self.torch.clone()}
        if self.numpy is not None:
            kind, keys, pos, has_gauss, cached = self.numpy
            state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                              "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        if self.python is not None:
            version, internal, gauss_next = self.python
            state["python"] = {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                               "gauss_next": gauss_next}
        if self.cuda is not None:
            state["cuda"] = [t.clone() for t in self.cuda]
        return state

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RngState:
        """The inverse of :meth:`to_dict`."""
        numpy_state = python_state = None
        if (n := state.get("numpy")) is not None:
            numpy_state = (n["kind"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                           float(n["cached_gaussian"]))
        if (p := state.get("python")) is not None:
            python_state = (int(p["version"]), tuple(int(x) for x in p["internal"].tolist()), p["gauss_next"])
        cuda = tuple(state["cuda"]) if state.get("cuda") is not None else None
        return cls(state["torch"], cuda, numpy_state, python_state)


def _same_tensors(a: tuple[torch.Tensor, ...] | None, b: tuple[torch.Tensor, ...] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_numpy(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:]))


# ---- the file form of the older functions' callers ---------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """All global RNG states in the file form (:meth:`RngState.to_dict`)."""
    return RngState.capture().to_dict()


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back a file-form state (:func:`get_rng_state`)."""
    RngState.from_dict(state).restore()


# ---- seeds --------------------------------------------------------------------------------------


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and python from one integer."""
    seed = int(seed) % (2**32)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def derive_seed(*parts: int) -> int:
    """A seed that depends only on ``parts`` (e.g. random_seed, epoch, step), not on history."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h % (2**31 - 1)


def model_init_seed(random_seed: int, epoch: int, step: int) -> int:
    """RETURNN's seed before ``get_model``: the same initial weights as RETURNN for the same config."""
    return (epoch * 193939 + step * 19937 + random_seed * 27644437 + 479001599) % (2**31)


def epoch_seed(*parts: int) -> int:
    """RETURNN's seed at an epoch start from ``(epoch, global_train_step, random_seed[, rank])``:
    the first 4 bytes (big-endian) of the sha256 of the parts as signed 64-bit big-endian ints."""
    combined = b"".join(int(p).to_bytes(8, "big", signed=True) for p in parts)
    return int.from_bytes(hashlib.sha256(combined).digest()[:4], "big")
