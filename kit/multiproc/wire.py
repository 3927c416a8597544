"""What crosses between the kernel and its worker processes: the config by value, training states as
bytes, step results on the CPU, per-rank status lines and a failure's context.

The config goes by value with ``cloudpickle`` (functions and classes defined in notebook cells have
no module a worker could import them from); states go in their versioned file form
(:meth:`~kit.engine.state.TrainingState.to_file`, tensors, numbers and strings), so a worker reads
them with ``torch.load(weights_only=True)``. The kernel always holds a state in single-process
terms: a rank's data position ``k`` (``k`` batches of its share) is ``k * N`` batches of the
epoch's plan, and back.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import Any

import torch

from kit.engine.accounting import StepLosses
from kit.engine.state import TrainingState, cpu_copy
from kit.engine.step import StepResult
from kit.errors import KitError


def dumps(obj: Any) -> bytes:
    """``obj`` by value (notebook functions and classes too)."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - a dependency of the processes extra
        raise KitError("processes=N ships the config to the worker processes with cloudpickle: "
                       "pip install cloudpickle (or kit-train[processes])") from None
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:
        raise KitError(f"processes=N: the config cannot be sent to the worker processes "
                       f"({type(exc).__name__}: {exc}); keep what it holds picklable (no open files, "
                       "locks or generators)") from exc


def loads(data: bytes) -> Any:
    """What :func:`dumps` (or ``pickle``) made, between the kernel and its own workers only."""
    import pickle

    return pickle.loads(data)  # noqa: S301 - bytes from this kernel's own worker processes


def state_bytes(state: TrainingState, world_size: int) -> bytes:
    """A training state as bytes, its data position in single-process terms (``world_size`` ranks made it)."""
    form = state.to_file()
    form["pipeline"] = _position(form.get("pipeline"), world_size, 1)
    form["accounting"] = cpu_copy(form.get("accounting"))  # capture() leaves the loss sums where they are
    form["grads"] = state.grads if state.progress.accum_count else None
    buffer = io.BytesIO()
    torch.save({"state": form, "weights": state.weights}, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes, world_size: int) -> TrainingState:
    """The state of :func:`state_bytes`, its data position made a rank's of ``world_size``."""
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    form = dict(loaded["state"])
    form["pipeline"] = _position(form.get("pipeline"), 1, world_size)
    return TrainingState.from_file(form, weights=loaded["weights"], source="the kernel's training state")


def _position(pipeline: dict[str, Any] | None, from_size: int, to_size: int) -> dict[str, Any] | None:
    """A data position of one of ``from_size`` ranks as one of ``to_size`` (the batch count is dropped: a
    rank's share differs from the whole plan)."""
    if not pipeline:
        return pipeline
    consumed = int(pipeline["position"]) * from_size
    return {"epoch": pipeline["epoch"], "position": consumed // to_size}


def cpu_result(result: StepResult) -> StepResult:
    """A step result whose tensors live on the CPU (what a queue carries to the kernel)."""
    losses = result.step_losses
    cpu = StepLosses(list(losses.names), [t.detach().cpu() for t in losses.sums],
                     [t.detach().cpu() for t in losses.norms], losses.errors)
    norm = result.grad_norm.detach().cpu() if result.grad_norm is not None else None
    return dataclasses.replace(result, step_losses=cpu, grad_norm=norm)


@dataclass(frozen=True)
class RankStatus:
    """Where one worker stands (sent at most a few times a second): the dashboard's per-rank strip."""

    rank: int
    epoch: int
    step: int  # the next step's index in its epoch
    global_train_step: int
    steps_per_sec: float
    memory_bytes: int | None  # CUDA: allocated on its device; CPU: the process' resident set
    device: str


@dataclass(frozen=True)
class Failure:
    """A worker's error: its text and traceback, the exception when it pickles, its step's context."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: bytes | None  # the pickled exception, when it pickles
    context: dict[str, Any] | None  # the DebugContext's fields but model, optimizer and keeper
    state: bytes | None  # the failing rank's training state at the failing step


class RemoteTraceback(Exception):
    """The worker's traceback, as the ``__cause__`` of the error it raised."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\nthe worker process' traceback:\n{self.text}"


class WorkerError(KitError):
    """A worker process failed (its own error did not pickle, or the process died)."""
