"""``Schedule``: the learning rate of each epoch and step, and the accumulation window of each micro-batch.

The epoch's learning rate comes from the LR control (``learning_rate``, ``learning_rates``,
``learning_rate_control``, a RETURNN ``learning_rate_file``); a step's from
``dynamic_learning_rate`` when it is set (RETURNN sets it before a step from the position after
the previous one), else the epoch's. :meth:`hold` pins one learning rate for the steps that
follow — the LR finder's probes — until the next epoch starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kit.engine.guard import check_learning_rate
from kit.engine.user_code import call_user

if TYPE_CHECKING:
    from kit.data.batch import Batch
    from kit.engine.lr_control import LearningRateControl
    from kit.engine.progress import Progress
    from kit.engine.updater import Updater


class Schedule:
    """Learning rates per epoch and step (set on the updater), accumulation windows per micro-batch."""

    def __init__(self, lr_control: LearningRateControl, updater: Updater):
        self.lr_control, self.updater = lr_control, updater
        self.epoch_lr = 0.0  # the running epoch's (LR control)
        self.step_lr = 0.0  # the last step's (dynamic_learning_rate may change it per step)
        self.held: float | None = None  # a learning rate pinned by hold()

    def begin_epoch(self, epoch: int) -> float:
        """The epoch's learning rate, from the LR control, set on the optimizer."""
        lr = float(self.lr_control.learning_rate_for_epoch(epoch))
        check_learning_rate(lr, "the learning rate control (learning_rate, learning_rates, learning_rate_file)",
                            f"epoch {epoch}")
        self.epoch_lr, self.held = lr, None
        self._set(lr)
        return lr

    def for_step(self, progress: Progress, dynamic: Callable[..., float] | None) -> float:
        """The learning rate of the step about to run: held, ``dynamic_learning_rate``'s, or the epoch's."""
        lr = self.epoch_lr if self.held is None else self.held
        if dynamic is not None and self.held is None:
            # RETURNN sets the lr before a step from the position after the previous one
            # (epoch - 1 at the first step of an epoch), not from the batch about to be trained
            p = progress
            lr = self.lr_control.dynamic_learning_rate(
                global_train_step=p.global_train_step, epoch=p.epoch,
                epoch_continuous=p.epoch - 1 + p.last_complete_frac, learning_rate=self.epoch_lr)
            check_learning_rate(lr, "config key 'dynamic_learning_rate'", f"global step {p.global_train_step}")
        if lr != self.step_lr:
            self._set(lr)
        return lr

    def hold(self, lr: float | None) -> None:
        """Pin ``lr`` for the following steps (None: back to the schedule)."""
        self.held = lr

    def _set(self, lr: float) -> None:
        self.updater.set_learning_rate(lr)
        self.step_lr = lr

    @staticmethod
    def accum_window(value: Any, progress: Progress, batch: Batch) -> int:
        """Micro-batches per update (``accum_grad_multiple_step``, a number or a function)."""
        if callable(value):
            frac = batch.complete_frac if batch.complete_frac is not None else 0.0
            value = call_user(value, "accum_grad_multiple_step", epoch=progress.epoch,
                              epoch_continuous=progress.epoch - 1 + frac, global_train_step=progress.global_train_step)
        return max(1, int(value))

    def state_dict(self) -> dict[str, float]:
        return {"epoch": self.epoch_lr, "step": self.step_lr}

    def load_state_dict(self, state: dict[str, float], *, epoch_running: bool) -> None:
        self.epoch_lr, self.step_lr, self.held = float(state.get("epoch", 0.0)), float(state.get("step", 0.0)), None
        if epoch_running:
            self.updater.set_learning_rate(self.step_lr)
