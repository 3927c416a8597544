"""Worker processes that load and collate planned batches (``torch_dataloader_opts``).

The main process owns the plan; a ``DataLoader(batch_size=None)`` gets, through its
sampler, ``(batch_idx, PlannedBatch)`` items from the current position on and returns
collated batches in the same order. Nothing is split per worker, so nothing is
duplicated (RETURNN iterates the whole dataset in every worker).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils.data

from kit.data.batch import Batch
from kit.data.batching import PlannedBatch
from kit.data.collate import BatchLoader
from kit.errors import ConfigError, DataError

_RESERVED = ("batch_size", "batch_sampler", "sampler", "shuffle", "collate_fn", "drop_last", "dataset")


class _PlanItems(torch.utils.data.Dataset):
    """Map-style view whose "index" is the plan item itself: the worker needs no plan copy."""

    def __init__(self, loader: BatchLoader):
        self.loader = loader

    def __getitem__(self, item: tuple[int, PlannedBatch]) -> Batch:
        return self.loader(item)


class _PlanSampler:
    """Yields the plan items from ``start``; re-pointed by the pipeline before each ``iter()``."""

    def __init__(self) -> None:
        self.items: Sequence[tuple[int, PlannedBatch]] = []

    def __iter__(self) -> Iterator[tuple[int, PlannedBatch]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def _identity(batch: Any) -> Any:  # the loader's batches come whole (batch_size=None)
    return batch


def check_picklable(loader: BatchLoader, num_workers: int, name: str) -> None:
    """Fail early and clearly, instead of deep inside a worker start."""
    try:
        pickle.dumps(loader)
    except Exception as exc:  # pickling raises many types (PicklingError, TypeError, AttributeError)
        raise DataError(
            f"dataset {name} cannot be pickled for num_workers={num_workers} worker processes "
            f"({type(exc).__name__}: {exc}); use module-level functions instead of lambdas/closures, "
            "or set num_workers=0 (torch_dataloader_opts={'num_workers': 0})"
        ) from exc


class WorkerPool:
    """A persistent ``DataLoader`` over plan items; ``start(items)`` returns a batch iterator."""

    def __init__(self, loader: BatchLoader, num_workers: int, opts: dict[str, Any] | None = None):
        opts = dict(opts or {})
        bad = [k for k in opts if k in _RESERVED]
        if bad:
            raise ConfigError(
                f"torch_dataloader_opts: {bad} are set by kit's batch plan (batch_size, max_seqs, seq_ordering); "
                "remove them"
            )
        opts.setdefault("persistent_workers", True)
        # Without its own generator, a DataLoader draws the workers' base seed from the global torch
        # RNG when its iterator is created: that shifts training randomness (dropout) by one draw at
        # the first batch of a process, so a resumed run would diverge from an uninterrupted one.
        opts.setdefault("generator", torch.Generator())
        self.sampler = _PlanSampler()
        try:
            self.dataloader = torch.utils.data.DataLoader(
                _PlanItems(loader),
                batch_size=None,
                sampler=self.sampler,
                collate_fn=_identity,
                num_workers=num_workers,
                **opts,
            )
        except TypeError as exc:
            raise ConfigError(f"torch_dataloader_opts: {exc}") from None

    def start(self, items: Sequence[tuple[int, PlannedBatch]]) -> Iterator[Batch]:
        self.sampler.items = items
        return iter(self.dataloader)

    def close(self) -> None:
        it = getattr(self.dataloader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.dataloader._iterator = None
