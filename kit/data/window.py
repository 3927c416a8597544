"""RETURNN's ``window``: input features as a sliding window over time.

With ``window = w`` (odd), frame ``t`` of a ``[T, D]`` input becomes frames ``t - w//2 .. t + w//2``
side by side (``[T, D * w]``, the earliest first), with zero frames beyond the sequence's edges.
RETURNN's generated and cached datasets (``GeneratingDataset`` such as ``Task12AXDataset``,
``HDFDataset``; kit's Task12AXDataset and HDFDataset) do this to the ``data`` key when the config
or the dataset dict sets ``window``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kit.config.keys import odd_window
from kit.errors import ConfigError


def check_window(window: Any, where: str) -> int:
    """``window`` as an int (1 for None); a ConfigError naming the key when it is not an odd int >= 1."""
    problem = odd_window(window)
    if problem:
        raise ConfigError(f"{where}: window must be {problem}, got {window!r}")
    return 1 if window is None else int(window)


def sliding_window(x: np.ndarray, window: int) -> np.ndarray:
    """``x`` (``[T, D]``) as ``[T, D * window]``: each frame with its ``window // 2`` neighbours on
    either side, zero-padded at the edges (RETURNN's layout: the earliest frame's features first)."""
    if window == 1:
        return x
    if x.ndim != 2:
        raise ConfigError(f"window: needs dense [time, feature] input, got an array of shape {x.shape}")
    half = window // 2
    padded = np.concatenate([np.zeros((half, x.shape[1]), x.dtype), x, np.zeros((half, x.shape[1]), x.dtype)])
    return np.concatenate([padded[k : k + x.shape[0]] for k in range(window)], axis=1)
