"""``TrainingState``: the one snapshot of everything a bit-exact continuation needs — and the only undo.

Checkpoints write it (:meth:`TrainingState.to_file` is the ``.opt.pt`` content, the weights go to
the model file), ``restore`` and a resume read it back, ``lr_find`` takes one before its sweep and
puts it back after, and the non-finite guard's deferred mode rewinds to one. What it holds:
progress, weights and buffers, optimizer, grad scaler, LR control and the learning rates, data
position, the epoch's loss sums, an open accumulation window's gradients, the RNG states, which data
loaders RETURNN's engine would have iterated (their draws from torch's generator) and a copy of the
score table.

The file form is versioned (``"version"``) and holds tensors, numbers and strings only, so it
loads with ``torch.load(weights_only=True)``; ``"optimizer"`` and ``"param_names"`` sit at the top,
as in RETURNN's ``.opt.pt``, so that RETURNN can continue from kit's files.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from kit.engine.progress import Progress
from kit.errors import CheckpointError
from kit.rng import RngState

VERSION = 1


@dataclass
class TrainingState:
    """A snapshot of the training state (in memory: CPU copies that later training never changes)."""

    progress: Progress
    rng: RngState
    weights: dict[str, torch.Tensor] | None = None  # model.state_dict(); in the file form, the model file's
    optimizer: dict[str, Any] | None = None  # the torch optimizer's state_dict
    updater: dict[str, Any] | None = None  # the optimizer's class, learning rate and parameter names
    grad_scaler: dict[str, Any] | None = None
    lr_control: dict[str, Any] | None = None
    learning_rates: dict[str, float] | None = None  # {"epoch": .., "step": ..}
    pipeline: dict[str, Any] | None = None  # the data position (while an epoch runs)
    accounting: dict[str, Any] | None = None  # the running epoch's loss sums
    grads: dict[str, torch.Tensor] | None = None  # the gradients (the file form keeps an open window's only)
    scores: str | None = None  # the score table as JSON text (its rows come back if the file is lost)
    # the DataLoaders RETURNN's engine would have iterated so far ({"train": bool, "eval": [names]}): what they
    # draw from torch's generator depends on it (kit.engine.loader_draws); None: a new process's (RETURNN's files)
    loaders: dict[str, Any] | None = None
    training_mode: bool | None = None  # the model's train()/eval() mode (in memory only)

    def to_file(self) -> dict[str, Any]:
        """The ``.opt.pt`` content (without the weights: they are the model file's)."""
        updater = dict(self.updater) if self.updater is not None else None
        return {
            "version": VERSION,
            "progress": self.progress.state_dict(),
            "optimizer": self.optimizer,
            "param_names": updater.get("param_names") if updater else None,
            "updater": updater,
            "grad_scaler": self.grad_scaler,
            "pipeline": self.pipeline,
            "accounting": self.accounting,
            "rng": self.rng.to_dict(),
            "learning_rate": dict(self.learning_rates or {"epoch": 0.0, "step": 0.0}),
            "grads": self.grads if self.progress.accum_count else None,
            "scores": self.scores,
            **({"loaders": self.loaders} if self.loaders is not None else {}),
            **({"lr_control": self.lr_control} if self.lr_control is not None else {}),
        }

    @classmethod
    def from_file(cls, state: dict[str, Any], *, weights: dict[str, torch.Tensor] | None = None,
                  source: str = "training state") -> TrainingState:
        """Read a :meth:`to_file` dict (or one that ``kit.compat`` made from RETURNN's ``.opt.pt``)."""
        version = state.get("version", VERSION)
        if not isinstance(version, int) or version > VERSION:
            raise CheckpointError(f"{source}: training-state version {version!r} is newer than this kit reads "
                                  f"({VERSION}); update kit")
        if "progress" not in state or "rng" not in state:
            raise CheckpointError(f"{source}: not a kit training state (no 'progress' / 'rng')")
        updater = state.get("updater")
        if updater is not None and state.get("param_names") is not None:
            updater = {**updater, "param_names": state["param_names"]}
        lr = state.get("learning_rate") or {}
        return cls(
            progress=Progress.from_state_dict(state["progress"]),
            rng=RngState.from_dict(state["rng"]),
            weights=weights,
            optimizer=state.get("optimizer"),
            updater=updater,
            grad_scaler=state.get("grad_scaler"),
            lr_control=state.get("lr_control"),
            learning_rates={"epoch": float(lr.get("epoch", 0.0)), "step": float(lr.get("step", 0.0))},
            pipeline=state.get("pipeline"),
            accounting=state.get("accounting"),
            grads=state.get("grads"),
            scores=state.get("scores"),
            loaders=state.get("loaders"),
        )


def cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor copied to the CPU (a snapshot that training never changes)."""
    return _copied(obj, lambda t: t.detach().to("cpu", copy=True))


def detached_copy(obj: Any) -> Any:
    """A deep copy with every tensor cloned where it is (a device snapshot: fast, but device memory)."""
    return _copied(obj, lambda t: t.detach().clone())


def _copied(obj: Any, tensor_copy: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return tensor_copy(obj)
    if isinstance(obj, dict):
        return {k: _copied(v, tensor_copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v, tensor_copy) for v in obj)
    return copy.deepcopy(obj)
