"""Capture and restore every RNG a training step may touch (torch, CUDA, numpy, python).

States are stored as tensors, ints and strings only, so checkpoints holding them load
with ``torch.load(weights_only=True)`` and no allow-list.

In memory (:func:`snapshot` / :func:`restore`, what a session swaps around every call), numpy's
and python's Mersenne Twisters are also read and written as their raw words (:class:`Words`):
``get_state``/``getstate`` build hundreds of Python ints each time, ~40 µs between training steps.
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

    ``like``: an earlier snapshot the state may still equal; numpy's and python's parts of it are
    reused when their generators have not moved since (:func:`numpy_state`, :func:`python_state`),
    which is what makes a session's world swap cheap."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # initialized: available
    return (torch.default_generator.get_state(), numpy_state(like[1] if like is not None else None),
            python_state(like[2] if like is not None else None), cuda)


def restore(snap: tuple, now: tuple | None = None) -> None:
    """Put back a :func:`snapshot`; ``now``: a snapshot of the current state, when one was just taken
    (numpy's and python's states are then set only when they differ)."""
    torch_state, np_state, py_state, cuda = snap
    torch.set_rng_state(torch_state)
    if now is None or now[1] is not np_state:
        set_numpy_state(np_state, now[1] if now is not None else None)
    if now is None or now[2] is not py_state:
        set_python_state(py_state, now[2] if now is not None else None)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class Words:
    """A generator's state words where they lie in memory, read in one copy through a numpy view
    (a microsecond, where ``get_state``-like calls build hundreds of Python ints) and written in place.

    ``owner``, the generator, is held: the memory stays its own while the view exists."""

    __slots__ = ("owner", "view")

    def __init__(self, owner: Any, address: int, nbytes: int):
        self.owner = owner
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))

    def read(self) -> bytes:
        return self.view.tobytes()

    def write(self, raw: bytes) -> None:
        self.view[:] = np.frombuffer(raw, np.uint8)


class NumpyState:
    """numpy's global RandomState: its full state (``np.random.get_state``), and the raw words of its
    MT19937 generator (624 keys and the position, through numpy's public ``ctypes`` interface)
    that tell in a microsecond whether it moved. ``get_state``/``set_state`` copy the keys one by
    one (~50 µs each). ``words`` (its generator: ``words.owner``) only where ``raw`` was confirmed."""

    __slots__ = ("state", "raw", "words")

    def __init__(self, state: dict[str, Any], raw: bytes | None, words: Words | None):
        self.state, self.raw, self.words = state, raw, words


_MT_KEY_BYTES = 624 * 4  # mt19937_state: uint32 key[624]; int pos


def _mt_words(known: Words | None = None) -> Words | None:
    """The global RandomState's MT19937 words (``known`` again while it is still the generator);
    None where the generator is not an MT19937."""
    get_bit_generator = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    generator: Any = get_bit_generator() if get_bit_generator is not None else None
    if known is not None and known.owner is generator:
        return known
    if type(generator).__name__ != "MT19937":
        return None
    return Words(generator, generator.ctypes.state_address, _MT_KEY_BYTES + 4)


def set_numpy_state(state: NumpyState, now: NumpyState | None = None) -> None:
    """Put back numpy's global RNG state; ``now``: the current one, taken just before.

    Where neither holds a cached Gaussian, the generator's raw words are all that differs, and
    they are copied back in one move (numpy's ``set_state`` copies them one by one, ~50 µs)."""
    words = _mt_words(state.words)
    if (now is not None and words is not None and state.raw is not None and state.words is words
            and now.words is not None and now.words.owner is words.owner and now.raw == words.read()
            and not state.state["has_gauss"] and not now.state["has_gauss"]):
        words.write(state.raw)
        return
    np.random.set_state(state.state)


def numpy_state(like: NumpyState | None = None) -> NumpyState:
    """numpy's global RNG state; ``like`` itself when the generator's words still equal its own.

    Exact: the words are the whole generator; the rest of the state is the legacy cached Gaussian,
    and ``like`` is reused only when it had none, since drawing one moves the words. (The one way
    past this: ``np.random.set_state`` of a state with the same words and a cached Gaussian.)"""
    words = _mt_words(like.words if like is not None else None)
    if (like is not None and words is not None and like.words is words and like.raw == words.read()
            and not like.state["has_gauss"]):
        return like
    state: dict[str, Any] = np.random.get_state(legacy=False)  # type: ignore[assignment]
    raw = words.read() if words is not None else None
    if raw is not None:  # trusted only where the raw layout is the one read above
        key, pos = state["state"]["key"], state["state"]["pos"]
        if raw != key.astype(np.uint32).tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True):
            raw = None
    return NumpyState(state, raw, words if raw is not None else None)


class PythonState:
    """The ``random`` module's state (``random.getstate()``) and, where CPython's layout was
    confirmed, the raw words of its Mersenne Twister that tell in a microsecond whether it moved
    (``getstate`` builds 625 ints: ~15 µs warm, ~40 µs between training steps)."""

    __slots__ = ("state", "raw", "words")

    def __init__(self, state: tuple, raw: bytes | None, words: Words | None):
        self.state, self.raw, self.words = state, raw, words


_PY_WORDS = 625 * 4  # CPython's RandomObject after its object header: int index; uint32_t state[624]


def _python_words(inst: Any, state: tuple) -> Words | None:
    """The words of CPython's ``random.Random`` object ``inst``, trusted only when they are exactly
    the state ``random.getstate()`` just gave (the index, then the 624 words); else None."""
    internal = state[1]
    base = next((c for c in type(inst).__mro__ if c.__module__ == "_random"), None)  # _random.Random
    head = object.__basicsize__
    if (sys.implementation.name != "cpython" or base is None or base.__basicsize__ < head + _PY_WORDS
            or len(internal) != 625):
        return None
    words = Words(inst, id(inst) + head, _PY_WORDS)
    expected = np.array(internal[-1:], np.int32).tobytes() + np.array(internal[:-1], np.uint32).tobytes()
    return words if words.read() == expected else None


def set_python_state(state: PythonState, now: PythonState | None = None) -> None:
    """Put back the ``random`` module's state; ``now``: the current one, taken just before.

    Where neither caches a Gaussian and both words are the generator's, the words are copied back
    in one move (the bytes ``random.getstate`` confirmed for this object); else ``random.setstate``."""
    words = state.words
    if (now is not None and words is not None and state.raw is not None and now.words is not None
            and now.words.owner is words.owner and now.raw == words.read()
            and state.state[2] is None and now.state[2] is None):
        words.write(state.raw)
        return
    random.setstate(state.state)


def python_state(like: PythonState | None = None) -> PythonState:
    """The ``random`` module's state; ``like`` itself when its generator's words still equal its own.

    Exact: besides the words, the state holds the cached ``gauss_next``; ``like`` is reused only
    when it has none and none is cached now."""
    # the module's hidden instance (its functions are the instance's bound methods, unless patched)
    inst = getattr(random.getstate, "__self__", None)
    if (like is not None and like.words is not None and like.words.owner is inst and like.state[2] is None
            and inst.gauss_next is None and like.raw == like.words.read()):
        return like
    state = random.getstate()
    words = like.words if like is not None and like.words is not None and like.words.owner is inst else None
    if words is None and isinstance(inst, random.Random):
        words = _python_words(inst, state)
    raw = words.read() if words is not None else None
    return PythonState(state, raw, words)


def torch_rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """torch's CPU RNG state and, once CUDA is in use, every device's (what a step replay needs)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # initialized: available
    # the generator's own method: what torch.get_rng_state calls (~2 µs less per step between steps)
    return torch.default_generator.get_state(), cuda
