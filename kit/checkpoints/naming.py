"""Checkpoint names: RETURNN's ``<prefix>.<epoch:03d>.pt`` and kit's mid-epoch ``.step<N>``, the only
place that builds or parses them.

A checkpoint of epoch 3 under the prefix ``model`` is ``model.003.pt`` (weights),
``model.003.opt.pt`` (training state) and ``model.003.manifest.json``; a mid-epoch one inserts
the global train step: ``model.003.step00001250.pt``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_MODEL_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<epoch>\d{3,})(?:\.step(?P<step>\d+))?\.pt$")


@dataclass(frozen=True)
class ModelFileName:
    """The parts of a model file's path."""

    prefix: str
    epoch: int
    global_train_step: int | None  # None: an epoch checkpoint


def checkpoint_paths(
    prefix: str, epoch: int, *, global_train_step: int | None = None, kind: str = "epoch"
) -> tuple[str, str, str]:
    """(model file, training-state file, manifest) for a checkpoint of ``prefix``."""
    stem = f"{prefix}.{epoch:03d}"
    if kind == "step":
        stem += f".step{global_train_step:08d}"
    elif kind != "epoch":
        raise ValueError(f"checkpoint kind must be 'epoch' or 'step', got {kind!r}")
    return stem + ".pt", stem + ".opt.pt", stem + ".manifest.json"


def parse_model_path(path: str | os.PathLike[str]) -> ModelFileName | None:
    """``<prefix>.<epoch>[.step<N>].pt`` split into its parts; None for any other name."""
    m = _MODEL_FILE.match(os.fspath(path))
    if m is None:
        return None
    step = m["step"]
    return ModelFileName(m["prefix"], int(m["epoch"]), None if step is None else int(step))


def checkpoint_file_pattern(prefix: str) -> re.Pattern[str]:
    """Matches the base name of any of the three files of a checkpoint of ``prefix``;
    group 1 is the epoch, group 2 the global train step (None for an epoch checkpoint)."""
    return re.compile(
        re.escape(os.path.basename(prefix)) + r"\.(\d+)(?:\.step(\d+))?\.(?:pt|opt\.pt|manifest\.json)$"
    )
