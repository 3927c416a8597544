"""What a train step reads (``StepOptions``) and what it returns (``StepResult``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kit.config import Config
from kit.engine.accounting import StepLosses


@dataclass
class StepResult:
    """What one train step did. Loss values are read from the device only when asked.

    ``step`` is the step's 0-based index in its epoch and ``global_train_step`` its
    0-based global index (the ``step`` user code sees in the run context).
    """

    epoch: int
    step: int
    global_train_step: int
    learning_rate: float
    updated: bool
    seconds: float
    num_seqs: int
    complete_frac: float | None
    step_losses: StepLosses
    grad_norm: torch.Tensor | None = None  # before norm clipping, when gradient_clip_global_norm is set
    memory_peak: int | None = None  # bytes: the step's CUDA peak (None on other devices)

    @property
    def losses(self) -> dict[str, float]:
        """Normalized loss per name (sum / norm) — one device→host read, cached."""
        return self.step_losses.normalized()

    def __repr__(self) -> str:
        losses = ", ".join(f"{k} {v:.4g}" for k, v in self.losses.items())
        return f"StepResult(ep {self.epoch}, step {self.step}, global {self.global_train_step}: {losses})"


@dataclass(frozen=True)
class StepOptions:
    """The config values a train step reads, read once per config version (not per step)."""

    train_step: Callable[..., Any]
    accum_grad_multiple_step: Any  # int or callable
    dynamic_learning_rate: Callable[..., float] | None
    guard: bool
    log_every: int
    save_every: int  # 0: no step checkpoints
    accum_fixed: int | None = None  # micro-batches per update when the config gives a number (not a function)

    @classmethod
    def read(cls, config: Config) -> StepOptions:
        accum = config.typed_value("accum_grad_multiple_step")
        return cls(
            train_step=config.typed_value("train_step"),
            accum_grad_multiple_step=accum,
            dynamic_learning_rate=config.typed_value("dynamic_learning_rate"),
            guard=config.bool("stop_on_nonfinite_train_score"),
            log_every=1 if config.int("log_verbosity") >= 4 else config.int("log_every_n_steps"),
            save_every=(config.int("save_every_n_steps") or 0) if config.typed_value("model") else 0,
            accum_fixed=None if callable(accum) else max(1, int(accum)),
        )
