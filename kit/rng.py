"""Capture and restore every RNG a training step may touch (torch, CUDA, numpy, python).

States are stored as tensors, ints and strings only, so checkpoints holding them load
with ``torch.load(weights_only=True)`` and no allow-list.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import sys
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """A snapshot of all global RNG states."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]  # legacy=True: a tuple
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": int(py_version), "internal": torch.tensor(py_internal, dtype=torch.int64),
                   "gauss_next": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a snapshot from :func:`get_rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def snapshot(like: tuple | None = None) -> tuple:
    """A fast in-memory snapshot of all global RNG states (not for files: see get_rng_state).

    ``like``: an earlier snapshot the state may still equal; numpy's part of it is reused when
    numpy's generator has not moved since (see :func:`numpy_state`), which makes a session's
    world swap ~0.2 ms cheaper."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), numpy_state(like[1] if like is not None else None), random.getstate(), cuda


def restore(snap: tuple, now: tuple | None = None) -> None:
    """Put back a :func:`snapshot`; ``now``: a snapshot of the current state, when one was just taken
    (numpy's state is then set only when it differs)."""
    torch_state, np_state, py_state, cuda = snap
    torch.set_rng_state(torch_state)
    if now is None or now[1] is not np_state:
        set_numpy_state(np_state, now[1] if now is not None else None)
    random.setstate(py_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class NumpyState:
    """numpy's global RandomState: its full state (``np.random.get_state``), and the raw words of its
    MT19937 generator (624 keys and the position, read through numpy's public ``ctypes`` interface)
    that tell in a microsecond whether it moved. ``get_state``/``set_state`` copy the keys one by
    one (~50 µs each)."""

    __slots__ = ("state", "generator", "raw")

    def __init__(self, state: dict[str, Any], generator: Any, raw: bytes | None):
        self.state, self.generator, self.raw = state, generator, raw


_MT_KEY_BYTES = 624 * 4  # mt19937_state: uint32 key[624]; int pos


def _mt_words() -> tuple[Any, bytes] | None:
    """(the global RandomState's bit generator, its raw state); None where that is not an MT19937."""
    get_bit_generator = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    generator: Any = get_bit_generator() if get_bit_generator is not None else None
    if type(generator).__name__ != "MT19937":
        return None
    return generator, ctypes.string_at(generator.ctypes.state_address, _MT_KEY_BYTES + 4)


def set_numpy_state(state: NumpyState, now: NumpyState | None = None) -> None:
    """Put back numpy's global RNG state; ``now``: the current one, taken just before.

    Where neither holds a cached Gaussian, the generator's raw words are all that differs, and
    they are copied back in one move (numpy's ``set_state`` copies them one by one, ~50 µs)."""
    words = _mt_words()
    if (now is not None and words is not None and state.raw is not None and now.raw == words[1]
            and state.generator is words[0] is now.generator and not state.state["has_gauss"]
            and not now.state["has_gauss"]):
        ctypes.memmove(words[0].ctypes.state_address, state.raw, len(state.raw))
        return
    np.random.set_state(state.state)


def numpy_state(like: NumpyState | None = None) -> NumpyState:
    """numpy's global RNG state; ``like`` itself when the generator's words still equal its own.

    Exact: the words are the whole generator; the rest of the state is the legacy cached Gaussian,
    and ``like`` is reused only when it had none, since drawing one moves the words. (The one way
    past this: ``np.random.set_state`` of a state with the same words and a cached Gaussian.)"""
    words = _mt_words()
    if (like is not None and words is not None and like.generator is words[0] and like.raw == words[1]
            and not like.state["has_gauss"]):
        return like
    state: dict[str, Any] = np.random.get_state(legacy=False)  # type: ignore[assignment]
    raw = None
    if words is not None:  # trusted only where the raw layout is the one read above
        key, pos = state["state"]["key"], state["state"]["pos"]
        if words[1] == key.astype(np.uint32).tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True):
            raw = words[1]
    return NumpyState(state, words[0] if words is not None else None, raw)


def torch_rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """torch's CPU RNG state and, once CUDA is in use, every device's (what a step replay needs)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # initialized: available
    return torch.get_rng_state(), cuda
