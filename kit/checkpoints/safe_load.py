"""Loading one file safely: ``torch.load(weights_only=True)`` (the only call in kit), or safetensors.

A refused file is :class:`~kit.errors.UnsafeCheckpointError` when it would run code (a named global,
TorchScript, a legacy tar archive — see :mod:`kit.checkpoints.safety`), else
:class:`~kit.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

from kit import fileio
from kit.checkpoints.safety import code_carrying_reason
from kit.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

logger = logging.getLogger("kit")


class NotSafetensorsError(CorruptCheckpointError, UnsafeCheckpointError):
    """A ``.safetensors`` path holds something else (e.g. a pickle); it is never unpickled."""


class CheckpointNotFoundError(CorruptCheckpointError, FileNotFoundError):
    """A file a checkpoint needs is not there."""


def load(path: str | os.PathLike, *, unsafe_trust: bool = False, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """Load one file safely: ``torch.load(weights_only=True)``, or safetensors by content.

    ``mmap``: map the tensors' storage instead of reading it (a zip-format torch file only): reading the
    small entries of a large model file costs a few page reads.

    Raises:
        UnsafeCheckpointError: the file needs code execution to unpickle (the global is named).
        CorruptCheckpointError: truncated, corrupt or missing file.

    Only ``unsafe_trust=True`` unpickles arbitrary objects; do that only for files you trust.
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"Checkpoint file not found: {path}")
    fileio.check_regular_file(path, "checkpoint", CorruptCheckpointError)  # a FIFO would block the read
    if path.endswith(".safetensors"):
        return _load_safetensors(path, map_location)
    if unsafe_trust:
        logger.warning(
            "Loading %s with weights_only=False (unsafe_trust=True): this runs any code the file contains",
            path,
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=not unsafe_trust, mmap=mmap)  # noqa: S614
    except pickle.UnpicklingError as e:
        # torch words it "Unsupported global: GLOBAL os.system ..." or "unsupported GLOBAL posix.system whose
        # module posix is blocked"
        match = re.search(r"GLOBAL ([\w.]+)", str(e))
        refuse_if_code_carrying(path, match and f"unpickling it needs the global {match.group(1)!r}, which could run code")
        raise CorruptCheckpointError(
            f"Cannot load {path}: corrupt or not loadable safely ({_first_line(e)})"
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, UnicodeDecodeError, ValueError, OSError,
            TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:
        # TypeError: e.g. a storage whose size is negative (torch's record reader refuses the argument)
        refuse_if_code_carrying(path)
        raise CorruptCheckpointError(
            f"Cannot load {path}: the file is truncated or corrupt ({type(e).__name__}: {_first_line(e)})"
        ) from e


def refuse_if_code_carrying(path: str, reason: str | None = None) -> None:
    """:class:`UnsafeCheckpointError` when the refused file would run code (a planted file, not a torn one)."""
    reason = reason or code_carrying_reason(path)
    if reason:
        raise UnsafeCheckpointError(
            f"Refused to load {path}: {reason}. kit's own checkpoints never need that. If you trust the file, "
            f"use kit.checkpoints.load(path, unsafe_trust=True)."
        ) from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _import_safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise CheckpointError(
            "Reading/writing .safetensors files needs the optional package "
            "'safetensors' (pip install safetensors)"
        ) from e
    return safetensors.torch


def _load_safetensors(path: str, map_location: Any) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise NotSafetensorsError(
            f"{path} is named .safetensors but holds a {'zip (torch.save)' if head[:2] == b'PK' else 'pickle'} "
            f"file; it was not unpickled. Rename it to .pt to load it with weights_only=True."
        )
    if len(head) < 9 or head[8:9] != b"{":
        raise NotSafetensorsError(f"{path} is not a valid safetensors file (bad header)")
    st = _import_safetensors()
    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    try:
        return st.load_file(path, device=device)
    except Exception as e:  # safetensors raises its own SafetensorsError for bad files
        raise CorruptCheckpointError(
            f"Cannot load {path}: corrupt safetensors file ({_first_line(e)})"
        ) from e


def export_safetensors(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], path: str) -> str:
    """Write the weights as a ``.safetensors`` file (atomically); returns ``path``."""
    st = _import_safetensors()
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    tensors, seen = {}, set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"export_safetensors: {key!r} is a {type(value).__name__}, not a tensor")
        t = value.detach().cpu().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # safetensors refuses shared storage (tied weights)
        seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    import kit

    data = st.save(tensors, metadata={"format": "pt", "kit_version": kit.__version__})
    fileio.atomic_write_bytes(path, data)
    return path
