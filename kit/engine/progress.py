"""``Progress``: the single answer to "where are we" — saved in every checkpoint.

Its fields change only through its transitions (:meth:`begin_epoch`, :meth:`micro_batch_done`,
:meth:`update_done`, ...), in the manner of Lightning's loop progress: small named moves that say
exactly where a loop stopped. Everywhere else the fields are read-only (``tests/test_architecture.py``
checks that no other module assigns them); whoever needs a value that stays put takes :meth:`copy`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any


@dataclass(slots=True)
class Progress:
    """Counters of the training loop.

    ``epoch`` is the epoch being trained (or the next one when none is running);
    ``global_train_step`` counts micro-batches (RETURNN's meaning), ``num_updates``
    optimizer steps; ``accum_count`` micro-batches in the open accumulation window.
    """

    epoch: int = 1
    step_in_epoch: int = 0
    global_train_step: int = 0
    num_updates: int = 0
    accum_count: int = 0
    epoch_running: bool = False  # epoch_begin done, epoch_end not yet
    steps_exhausted: bool = False  # the data of the running epoch is consumed
    consec_skipped_updates: int = 0
    skipped_updates_in_epoch: int = 0
    epoch_start_global_step: int = 0
    last_complete_frac: float = 0.0  # of the last batch trained: RETURNN's epoch_continuous of the next step

    # ---- transitions (the only writers of the fields) -------------------------------------------

    @classmethod
    def starting_at(cls, epoch: int, global_train_step: int) -> Progress:
        """Where a run starts (fresh, resumed from an epoch checkpoint, or ``load``)."""
        return cls(epoch=epoch, global_train_step=global_train_step)

    def begin_epoch(self) -> None:
        self.epoch_running, self.steps_exhausted, self.step_in_epoch = True, False, 0
        self.skipped_updates_in_epoch, self.epoch_start_global_step = 0, self.global_train_step
        self.last_complete_frac = 0.0

    def data_exhausted(self) -> None:
        self.steps_exhausted = True

    def data_again(self) -> None:
        """The epoch's data planned again (the LR finder's probes run past its end)."""
        self.steps_exhausted = False

    def micro_batch_added(self) -> None:
        """A micro-batch's gradients joined the accumulation window."""
        self.accum_count += 1

    def step_done(self, complete_frac: float | None) -> None:
        """A train step ended (``complete_frac``: of its batch, RETURNN's epoch position)."""
        self.step_in_epoch += 1
        self.global_train_step += 1
        if complete_frac is not None:
            self.last_complete_frac = complete_frac

    def update_done(self) -> None:
        """The optimizer stepped: the accumulation window closes."""
        self.num_updates += 1
        self.accum_count = self.consec_skipped_updates = 0

    def window_dropped(self, *, skipped: bool) -> None:
        """A non-finite micro-batch dropped its window (``skipped``: counted under ``nonfinite_policy="skip"``)."""
        self.accum_count = 0
        if skipped:
            self.consec_skipped_updates += 1
            self.skipped_updates_in_epoch += 1

    def end_epoch(self) -> None:
        self.epoch, self.epoch_running, self.steps_exhausted, self.step_in_epoch = self.epoch + 1, False, False, 0

    def move_to(self, other: Progress) -> None:
        """Become ``other`` (a restore of the training state)."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))

    def copy(self) -> Progress:
        """A value that stays put while training goes on."""
        return replace(self)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Progress:
        """Unknown keys are ignored, missing ones keep their defaults."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})

    def where(self) -> str:
        if self.epoch_running:
            return f"epoch {self.epoch}, step {self.step_in_epoch}"
        return f"start of epoch {self.epoch}"
