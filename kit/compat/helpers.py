"""Small helpers that RETURNN configs import from ``returnn.util.basic`` (used when RETURNN is absent)."""

from __future__ import annotations

import getpass
import os
import re


class NotSpecified:
    """RETURNN's marker for "argument not given"."""


class BackendEngine:
    """RETURNN's backend selector; kit is always the torch backend."""

    Torch = 2
    selected_engine = Torch

    @classmethod
    def is_torch_selected(cls) -> bool:
        return True

    @classmethod
    def is_tensorflow_selected(cls) -> bool:
        return False


def get_login_username() -> str:
    """The login name (as RETURNN: the user of the process, also without a terminal)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid()) if hasattr(os, "getuid") else "unknown"


def get_model_filename_postfix() -> str:
    """The model file suffix of the torch backend."""
    return ".pt"


def model_epoch_from_filename(filename: str) -> int:
    """The epoch in a checkpoint name like ``model.012`` or ``model.012.pt``."""
    match = re.search(r"\.(\d+)(\.pt)?$", filename)
    if match is None:
        raise ValueError(f"no epoch in the model file name {filename!r}")
    return int(match.group(1))


def human_size(n: float, factor: int = 1000, frac: float = 0.8, prec: int = 1) -> str:
    """``1500`` -> ``"1.5K"``."""
    postfixes = ["", "K", "M", "G", "T"]
    i = 0
    while i < len(postfixes) - 1 and n > (factor ** (i + 1)) * frac:
        i += 1
    if i == 0:
        return str(n)
    return f"{float(n) / factor**i:.{prec}f}{postfixes[i]}"


def human_bytes_size(n: float, factor: int = 1024, frac: float = 0.8, prec: int = 1) -> str:
    """``2048`` -> ``"2.0KB"``."""
    return human_size(n, factor=factor, frac=frac, prec=prec) + "B"
