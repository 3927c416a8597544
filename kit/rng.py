"""Capture and restore every RNG a training step may touch (torch, CUDA, numpy, python).

States are stored as tensors, ints and strings only, so checkpoints holding them load
with ``torch.load(weights_only=True)`` and no allow-list.
"""

from __future__ import annotations

import hashlib
import random
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


def snapshot() -> tuple:
    """A fast in-memory snapshot of all global RNG states (not for files: see get_rng_state)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), np.random.get_state(), random.getstate(), cuda


def restore(snap: tuple) -> None:
    """Put back a :func:`snapshot`."""
    torch_state, np_state, py_state, cuda = snap
    torch.set_rng_state(torch_state)
    np.random.set_state(np_state)
    random.setstate(py_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def torch_rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """torch's CPU RNG state and, once CUDA is in use, every device's (what a step replay needs)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # initialized: available
    return torch.get_rng_state(), cuda
