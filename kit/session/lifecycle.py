"""A session's state between calls: its :class:`Status`, why it refuses to train, and the training
weights kept while a checkpoint is inspected.

``session.status`` is the line a person reads, the enum's value with its detail (``"error: RuntimeError: boom"``,
``"inspecting model.003"``); its ``kind`` is the :class:`Status` enum (what views switch on).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kit.errors import SessionStateError

if TYPE_CHECKING:
    from kit.engine.progress import Progress


class Status(str, enum.Enum):
    """What a session is doing (a ``str``: ``Status.READY == "ready"``)."""

    READY = "ready"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    INSPECTING = "inspecting"  # the model holds a checkpoint's weights for a look
    ERROR = "error"
    CLOSED = "closed"


class StatusLine(str):
    """A session's status as the line a person reads (``"error: RuntimeError: boom"``); ``kind`` is the
    :class:`Status` enum views switch on. A ``str``: ``session.status == "ready"`` reads as before."""

    kind: Status

    def __new__(cls, text: str, kind: Status) -> StatusLine:
        line = super().__new__(cls, text)
        line.kind = kind
        return line


class SessionState:
    """Status and the conditions that keep a session from training (inspection, a half-done step)."""

    def __init__(self) -> None:
        self.status = Status.READY
        self.detail = ""  # the error, or what is inspected
        self.inspecting: str | None = None  # "checkpoint model.003": weights are not the training state
        self.stashed_weights: dict[str, torch.Tensor] | None = None  # the training weights while inspecting
        self.mid_step: str | None = None  # where a forced interrupt stopped a step half-way

    def set(self, status: Status, detail: str = "") -> None:
        self.status, self.detail = status, detail

    @property
    def line(self) -> StatusLine:
        return StatusLine(self.text, self.status)

    @property
    def text(self) -> str:
        if self.status is Status.ERROR:
            return f"error: {self.detail}" if self.detail else "error"
        if self.status is Status.INSPECTING:
            return f"inspecting {self.detail}"
        return self.status.value

    def failed(self, exc: BaseException) -> None:
        self.set(Status.ERROR, f"{type(exc).__name__}: {exc}".split("\n")[0])

    def interrupted_mid_step(self, progress: Progress) -> None:
        self.mid_step = progress.where()
        self.set(Status.ERROR, "interrupted mid-step")

    def inspect(self, model: torch.nn.Module, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        """``weights`` (of checkpoint ``name``) into ``model`` for a look; its training weights are kept
        on the host first (once: inspecting another checkpoint keeps the same training weights)."""
        from kit import checkpoints

        if self.stashed_weights is None:
            self.stashed_weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        checkpoints.load_into_model(model, dict(weights))
        self.inspecting = f"checkpoint {name}"
        self.set(Status.INSPECTING, name)

    def put_back_training_weights(self, model: torch.nn.Module) -> bool:
        """The training weights kept by :meth:`inspect` back into ``model``; False when none are kept."""
        if self.stashed_weights is None:
            return False
        from kit import checkpoints

        checkpoints.load_into_model(model, self.stashed_weights)
        return True

    def consistent(self) -> None:
        """Back to the training state (after a restore or reload)."""
        self.inspecting = self.stashed_weights = self.mid_step = None
        self.set(Status.READY)

    def check_can_train(self) -> None:
        if self.status is Status.CLOSED:
            raise SessionStateError("this session is closed; create a new one")
        if self.inspecting:
            raise SessionStateError(
                f"the model holds the weights of {self.inspecting} for inspection (checkpoints.load); "
                "call session.checkpoints.restore(...) to continue from that checkpoint, or "
                "session.checkpoints.reload_latest() to go back to the training state"
            )
        if self.mid_step:
            raise SessionStateError(
                f"the last train call was interrupted mid-step (a second interrupt within a second) at "
                f"{self.mid_step}: the model or optimizer may be half-updated; call "
                "session.checkpoints.restore(...) or session.checkpoints.reload_latest() to continue from a consistent state"
            )
