"""A checkpoint's manifest: its fields, and reading one without trusting it (any malformed one means
"incomplete checkpoint"), from its own file or (RETURNN's layout) from inside the model file.

A manifest is small JSON that kit wrote. Whatever else sits under its name — a flipped bit, a
number like ``1e999``, 100k nested brackets, megabytes of junk, a FIFO or a device — gives a
:class:`~kit.errors.CorruptCheckpointError` naming the file and what is wrong, never a raw
``KeyError`` / ``OverflowError`` / ``RecursionError``, and never a read that blocks.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

from kit import fileio
from kit.checkpoints.foreign import has_entry
from kit.checkpoints.safe_load import load
from kit.errors import CheckpointError, CorruptCheckpointError

MANIFEST_FORMAT = 1
EMBEDDED = "kit_manifest"  # the model file's entry holding the manifest in RETURNN's layout
MAX_MANIFEST_BYTES = 1 << 20  # kit's manifests are about 1 KB
_SHA256 = re.compile(r"[0-9a-f]{64}")
KINDS = ("epoch", "step")


def read_manifest_file(path: str) -> dict[str, Any]:
    """The parsed, shape-checked manifest at ``path``; :class:`CorruptCheckpointError` for anything else."""
    manifest = _parse(_read_regular_file(path), path)
    problem = manifest_problem(manifest)
    if problem is not None:
        raise CorruptCheckpointError(f"Manifest {path} is malformed: {problem}")
    return manifest


def _read_regular_file(path: str) -> bytes:
    """The bytes of ``path`` if it is a small regular file; never blocks (FIFOs, devices are refused)."""
    if not os.path.lexists(path):
        raise CorruptCheckpointError(f"Manifest {path} is missing (interrupted save or delete)")
    return fileio.read_capped(path, MAX_MANIFEST_BYTES, "Manifest", CorruptCheckpointError,
                              "kit's manifests are about 1 KB")


def _parse(data: bytes, path: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"Manifest {path} is not UTF-8 text (byte {e.start})") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"Manifest {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise CorruptCheckpointError(f"Manifest {path} is nested too deeply to be a manifest") from None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry_problem(name: str, entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"files.{name} is a {type(entry).__name__}, expected an object"
    if not isinstance(entry.get("name"), str):
        return f"files.{name}.name is {entry.get('name')!r}, expected a file name"
    if not _is_count(entry.get("size")):
        return f"files.{name}.size is {_show(entry.get('size'))}, expected an int >= 0"
    if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
        return f"files.{name}.sha256 is {_show(entry.get('sha256'))}, expected 64 hex digits"
    return None


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def manifest_problem(m: Any) -> str | None:
    """What is wrong with a parsed manifest (None when it has the shape kit writes)."""
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, expected an object"
    if not _is_count(m.get("format")):
        return f"format is {_show(m.get('format'))}, expected an int"
    if m.get("kind") not in KINDS:
        return f"kind is {_show(m.get('kind'))}, expected 'epoch' or 'step'"
    for key in ("epoch", "global_train_step"):
        if not _is_count(m.get(key)):
            return f"{key} is {_show(m.get(key))}, expected an int >= 0"
    files = m.get("files")
    if not isinstance(files, dict) or set(files) != {"model", "train_state"}:
        return f"files is {_show(files)}, expected an object with the entries 'model' and 'train_state'"
    for name in ("model", "train_state"):
        # a manifest inside the model file (RETURNN's layout, see files.py) cannot hold that file's own digest
        if files.get(name) is None and (name == "train_state" or m.get("embedded") is True):
            continue
        if (problem := _entry_problem(name, files.get(name))) is not None:
            return problem
    if not isinstance(m.get("config_digest", ""), str):
        return f"config_digest is {_show(m.get('config_digest'))}, expected a string"
    keys = m.get("config_keys", {})
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        return "config_keys is not an object of key -> digest strings"
    return None


def manifest_fields(epoch: int, global_train_step: int, kind: str, effective_learning_rate: float | None,
                     config_digest: str, extra_meta: dict | None, config_keys: Mapping[str, str] | None) -> dict:
    """The manifest without its ``files``; checked before anything is written."""
    import kit

    try:  # fail before writing hundreds of MB, not when writing the manifest
        extra_meta = json.loads(json.dumps(dict(extra_meta or {})))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save: extra_meta must be JSON-serializable ({e})") from e
    now = time.time()
    return {
        "format": MANIFEST_FORMAT,
        "kind": kind,
        "epoch": int(epoch),
        "global_train_step": int(global_train_step),
        "kit_version": kit.__version__,
        "torch_version": str(torch.__version__),  # a str subclass that weights_only loading refuses
        "config_digest": config_digest,
        "config_keys": dict(config_keys or {}),
        "effective_learning_rate": None if effective_learning_rate is None else float(effective_learning_rate),
        "time": now,
        "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "extra": extra_meta,
    }


def embedded_manifest(path: str) -> dict | None:
    """The manifest inside the model file at ``path`` (RETURNN's layout), or None: no such file, not kit's,
    no manifest inside, or one that does not read. Reads the file's small index only (tensors are mapped)."""
    if not has_entry(path, EMBEDDED):
        return None
    try:
        model_file = load(path, mmap=True)
    except CheckpointError:
        return None
    manifest = model_file.get(EMBEDDED) if isinstance(model_file, dict) else None
    if not isinstance(manifest, dict) or manifest.get("embedded") is not True or manifest_problem(manifest):
        return None
    return manifest
