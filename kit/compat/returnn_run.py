"""A RETURNN run directory in kit: continue from RETURNN's checkpoints, keep its learning-rate file.

- :func:`returnn_start` finds RETURNN's newest ``{model}.NNN.pt`` (a model file kit did not write:
  no manifest, no ``kit_version``) with its ``.opt.pt`` (RETURNN's optimizer-state format:
  ``{"optimizer": state_dict, "param_names": [...], ...}``) when it is newer than any kit
  checkpoint, and describes the training state to continue with. Nothing is written or removed.
- :class:`ReturnnScoreTable` keeps ``learning_rate_file`` in RETURNN's format (so RETURNN can
  continue the run) and, unless the run keeps RETURNN's layout (``run_files``), kit's JSON table beside
  it (``{learning_rate_file}.kit.json``). On load the RETURNN file wins for every epoch it has (RETURNN
  may have trained after kit).

The files kit writes into the run (``model.NNN.pt`` / ``.opt.pt``) are RETURNN-readable too: the
model file has RETURNN's keys, and the training state carries ``optimizer`` and ``param_names``
at its top level as RETURNN's ``.opt.pt`` does.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kit import checkpoints
from kit.errors import CorruptCheckpointError
from kit.fileio import atomic_write_text
from kit.scores import ScoreTable

logger = logging.getLogger("kit")

KIT_TABLE_SUFFIX = ".kit.json"


@dataclass(frozen=True)
class ReturnnCheckpoint:
    """One epoch checkpoint RETURNN wrote: ``{prefix}.{epoch:03d}.pt`` and maybe its ``.opt.pt``."""

    epoch: int
    path: str
    opt_path: str | None


def returnn_checkpoints(prefix: str) -> list[ReturnnCheckpoint]:
    """RETURNN's epoch checkpoints under ``prefix`` (files without a kit manifest), oldest first."""
    directory = os.path.dirname(os.path.abspath(prefix)) or "."
    base = os.path.basename(prefix)
    pattern = re.compile(re.escape(base) + r"\.(\d{3,})\.pt$")
    kit_names = {os.path.abspath(c.path) for c in checkpoints.list_checkpoints(prefix) if c.complete}
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        match = pattern.match(name)
        path = os.path.join(directory, name)
        if match is None or os.path.abspath(path) in kit_names:
            continue
        opt = path[: -len(".pt")] + ".opt.pt"
        found.append(ReturnnCheckpoint(int(match.group(1)), path, opt if os.path.isfile(opt) else None))
    return sorted(found, key=lambda c: c.epoch)


def _kit_position(prefix: str) -> float:
    """How far kit's newest complete checkpoint is: its epoch (a step checkpoint: half an epoch less)."""
    best = 0.0
    for ckpt in checkpoints.list_checkpoints(prefix):
        if ckpt.complete:
            best = max(best, ckpt.epoch if ckpt.kind == "epoch" else ckpt.epoch - 0.5)
    return best


def returnn_start(prefix: str | None, *, training: bool) -> dict[str, Any] | None:
    """Where to start from RETURNN's newest checkpoint under ``prefix`` (when newer than kit's), else None.

    Returns the keyword arguments of :class:`kit.engine.start.Start`; when training, a training
    state in kit's layout holding RETURNN's optimizer state. Reads only.
    """
    found = newest_returnn_checkpoint(prefix)
    if found is None:
        return None
    path, epoch, step = found["checkpoint"].path, found["epoch"], found["global_train_step"]
    logger.info("continuing RETURNN's run: %s (epoch %d, global step %d)", path, epoch, step)
    start = {"epoch": epoch, "global_train_step": step, "model_state": found["model_state"],
             "source": f"RETURNN checkpoint {path}", "first_train_epoch": False}
    if training:
        start["train_state"] = _train_state(found)
    return start


def _train_state(found: Mapping[str, Any]) -> dict[str, Any]:
    from kit.rng import get_rng_state

    lr, opt, epoch, step = found["learning_rate"], found["optimizer"], found["epoch"], found["global_train_step"]
    updater = None if opt is None else {"param_names": opt.get("param_names"), **({} if lr is None else {"learning_rate": lr})}
    return {
        "progress": {"epoch": epoch, "global_train_step": step, "epoch_start_global_step": step},
        "optimizer": None if opt is None else opt["optimizer"],
        "updater": updater,
        "rng": get_rng_state(),  # reseeded at the epoch start from (random_seed, epoch, step), as RETURNN does
        "learning_rate": {"epoch": lr or 0.0, "step": lr or 0.0},
    }


def newest_returnn_checkpoint(prefix: str | None) -> dict[str, Any] | None:
    """RETURNN's newest loadable checkpoint under ``prefix`` when it is newer than kit's; else None.

    Returns ``{"checkpoint", "model_state", "epoch" (the next one to train), "global_train_step",
    "optimizer" (RETURNN's .opt.pt content or None), "learning_rate"}``.
    """
    if not prefix:
        return None
    position = _kit_position(prefix)
    for ckpt in reversed(returnn_checkpoints(prefix)):
        if ckpt.epoch <= position:
            return None
        try:
            model_file = checkpoints.load(ckpt.path)
        except (CorruptCheckpointError, OSError, RuntimeError) as exc:
            logger.warning("RETURNN checkpoint %s does not load (%s); trying an older one", ckpt.path, exc)
            continue
        if not isinstance(model_file, dict) or not isinstance(model_file.get("model"), dict) or "kit_version" in model_file:
            continue  # not RETURNN's format (or an unfinished kit save): not ours to continue from
        return {
            "checkpoint": ckpt,
            "model_state": model_file["model"],
            "epoch": int(model_file.get("epoch") or ckpt.epoch) + 1,
            "global_train_step": int(model_file.get("step") or 0),
            "optimizer": _load_optimizer_state(ckpt),
            "learning_rate": model_file.get("effective_learning_rate"),
        }
    return None


def _load_optimizer_state(ckpt: ReturnnCheckpoint) -> dict[str, Any] | None:
    if ckpt.opt_path is None:
        logger.warning("RETURNN checkpoint %s has no optimizer file: continuing with a fresh optimizer", ckpt.path)
        return None
    try:
        state = checkpoints.load(ckpt.opt_path)
    except (CorruptCheckpointError, OSError, RuntimeError) as exc:
        logger.warning("RETURNN optimizer file %s does not load (%s): continuing with a fresh optimizer",
                       ckpt.opt_path, exc)
        return None
    if isinstance(state, dict) and "optimizer" not in state and "state" in state and "param_groups" in state:
        state = {"optimizer": state}  # RETURNN's oldest format: the bare optimizer state dict
    return state if isinstance(state, dict) and "optimizer" in state else None


# ---- the learning-rate file ---------------------------------------------------------------------


def kit_table_path(learning_rate_file: str) -> str:
    return learning_rate_file + KIT_TABLE_SUFFIX


class ReturnnScoreTable(ScoreTable):
    """A score table whose file is RETURNN's ``learning_rate_file``, with kit's JSON beside it."""

    side_table = True  # write kit's JSON table beside RETURNN's file (not in RETURNN's layout: run_files)

    @classmethod
    def open(cls, learning_rate_file: str, *, side_table: bool = True) -> ReturnnScoreTable:
        """kit's table (if there is one), then every epoch of RETURNN's file over it. ``side_table=False``:
        saving writes RETURNN's file only (an existing JSON table is still read, never written)."""
        table = cls(learning_rate_file)
        table.side_table = side_table
        side = kit_table_path(learning_rate_file)
        if os.path.exists(side):
            table.load_state_dict(ScoreTable.load(side).state_dict())
        if os.path.exists(learning_rate_file):
            other = ScoreTable.load(learning_rate_file)  # kit JSON (an older kit run) or RETURNN's format
            state = table.state_dict()
            for epoch, row in other.state_dict()["epochs"].items():
                mine = state["epochs"].get(epoch)
                if mine is None or mine["learning_rate"] != row["learning_rate"] or mine["scores"] != row["scores"]:
                    state["epochs"][epoch] = row
            state["error_keys"] = sorted(set(state["error_keys"]) | set(other.error_keys))
            table.load_state_dict(state)
        return table

    def save(self, path: str | os.PathLike | None = None) -> str:
        """RETURNN's format to the learning-rate file, kit's JSON beside it (both atomically)."""
        target = os.fspath(path) if path is not None else self.path
        if target is None:
            return super().save(path)
        if self.side_table:
            atomic_write_text(kit_table_path(target), self.to_json())
        atomic_write_text(target, returnn_lr_file_text(self))
        return target


def returnn_lr_file_text(table: ScoreTable) -> str:
    """The table as RETURNN writes its learning-rate file (``{epoch: EpochData(...), ...}``).

    Epochs without a learning rate are left out (RETURNN requires a float); meta values are kept
    when they are Python literals (numbers, strings, None, True/False, lists / tuples / dicts of them,
    e.g. RETURNN's ``':meta:distributed': None``), which both RETURNN's reader and kit's parser read back.
    """
    lines = ["{"]
    for epoch in table.epochs:
        lr = table.learning_rate(epoch)
        if lr is None:
            continue
        error: dict[str, Any] = {k: float(v) for k, v in table.scores(epoch).items()}
        for key, value in table.meta(epoch).items():
            if _is_literal(value):
                error[f":meta:{key}"] = value
        lines.append(f"{epoch}: EpochData(learningRate={_repr(float(lr))}, error={_dict_repr(error)}),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _is_literal(value: Any, depth: int = 0) -> bool:
    """Whether ``repr(value)`` reads back as ``value`` (a literal without objects), nested at most 20 deep."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth > 20:
        return False
    if isinstance(value, (list, tuple)):
        return all(_is_literal(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (int, str)) and _is_literal(v, depth + 1) for k, v in value.items())
    return False


def _repr(value: Any) -> str:
    # repr: exact floats; nan / inf / -inf are names both RETURNN's reader and kit's parser know
    return repr(value)


def _dict_repr(d: Mapping[str, Any]) -> str:
    if not d:
        return "{}"
    return "{\n" + "".join(f"{k!r}: {_repr(v)},\n" for k, v in sorted(d.items())) + "}"
