"""``Progress``: the single answer to "where are we" — saved in every checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
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

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in names:
                setattr(self, key, value)

    def where(self) -> str:
        if self.epoch_running:
            return f"epoch {self.epoch}, step {self.step_in_epoch}"
        return f"start of epoch {self.epoch}"
