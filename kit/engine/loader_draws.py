"""The numbers RETURNN's DataLoader draws from torch's global generator, drawn by kit too.

RETURNN seeds torch at each epoch's start and then iterates its train ``DataLoader``, which takes
seeds for its workers and datapipes from torch's global generator before the first batch: what a
model draws afterwards (dropout masks, ``rf.random``) starts from the generator *after* those draws.
kit loads its batches without a torch ``DataLoader`` in the main process, so it draws the same count
itself, right after seeding, and a model with dropout trains on RETURNN's masks.

The count follows torch's ``DataLoader`` and RETURNN's defaults (``torch_dataloader_opts``:
``num_workers`` 1, ``persistent_workers`` True when there are workers): one 64-bit number for the
workers' base seed and, for a datapipe (RETURNN's batching is one; a ``torch_batching`` batcher may
return a plain ``IterableDataset``), one for the datapipes' shared seed — both when an iterator is
made (every epoch in-process or without persistent workers; else the first epoch this engine trains),
and a multi-process iterator's reset draws the shared seed again, when it is made and at every later
epoch. ``tests/engine/test_loader_draws.py`` checks each case against torch's own DataLoader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def draws_per_iteration(loader_opts: Mapping[str, Any] | None, *, first: bool, datapipe: bool = True) -> int:
    """How many 64-bit numbers RETURNN's train DataLoader takes from torch's global generator when an epoch's
    iteration starts (``first``: the first iteration of the loader in this process)."""
    opts = dict(loader_opts or {})
    workers = int(opts.get("num_workers", 1) or 0)  # RETURNN's default: one worker process
    persistent = workers > 0 and bool(opts.get("persistent_workers", True))
    shared = 1 if datapipe else 0
    if workers == 0:
        return shared + 1  # a new in-process iterator each epoch: the shared seed, then the base seed
    if first or not persistent:
        return shared + 1 + shared  # a new multi-process iterator, which resets itself at once
    return shared  # the persistent iterator's reset


def draw(count: int) -> None:
    """Advance torch's global generator as ``count`` ``torch.empty((), dtype=torch.int64).random_()`` do."""
    for _ in range(count):
        torch.empty((), dtype=torch.int64).random_()


class LoaderDraws:
    """Which of RETURNN's DataLoaders an engine would have iterated in this process, drawing for each iteration
    what it would draw. ``state_dict`` is the training state's ``loaders`` (a resume continues the process)."""

    def __init__(self, config: Any):
        self.config = config
        self.train = False
        self.eval: set[str] = set()

    def before_train(self, datapipe: bool) -> None:
        """The train loader's draws, right after an epoch's seeding."""
        draw(draws_per_iteration(self.config.typed_value("torch_dataloader_opts"), first=not self.train,
                                 datapipe=datapipe))
        self.train = True

    def before_eval(self, name: str, datapipe: bool) -> None:
        """Eval dataset ``name``'s loader's draws, before its first batch."""
        draw(draws_per_iteration(self.config.typed_value("torch_dataloader_opts"), first=name not in self.eval,
                                 datapipe=datapipe))
        self.eval.add(name)

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "eval": sorted(self.eval)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.train, self.eval = bool(state.get("train")), set(state.get("eval") or ())
