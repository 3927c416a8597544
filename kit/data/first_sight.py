"""What the batch loader learns about each sequence the first time it loads it.

A dataset read through ``get_seq`` (or a torch dataset's items) is checked in full in the
first batch that holds a sequence: the declared layout and an accepted dtype kind for every
array of every declared key, the label range. Its time lengths are noted then. Later
batches of sequences seen before take the lengths from the notes instead of from every
array (a ``TorchDataset`` that read its items' lengths for the plan notes them from there), and skip the per-array dtype comparison; the checks that cost O(1) per key still
run on every batch: the joined array's layout and dtype kind, its frames against the noted
lengths (when they do not add up, the lengths come from the arrays), the label range.

Skipping the dtype comparison changes no batch: arrays of different accepted dtypes are
joined by numpy's or torch's type promotion, exact within a kind of number (a promotion
that is not, int64 with uint64 to float64, changes the kind and fails the check), so
casting the joined array to the declared dtype gives what casting each array did.

A dataset whose sequences change between epochs says so through ``Dataset.init_epoch``;
the pipeline then starts over with a new loader, and so with a new :class:`FirstSight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import numpy as np

from kit.data.batch import Field


def plain_dicts(items: list[Any]) -> bool:
    """Whether every item is a non-empty dict (checked for all at once)."""
    return bool(items) and set(map(type, items)) == {dict} and all(items)


def all_plain(items: list[Any]) -> bool:
    """Whether every item is a non-empty dict with str keys (as the dataset's check would return it)."""
    return plain_dicts(items) and all(type(k) is str for k in set(chain.from_iterable(items)))


class FirstSight:
    """Which sequences were checked, and their time length per key."""

    def __init__(self, num_seqs: int):
        self.seen = np.zeros(num_seqs, dtype=bool)
        self.lengths: dict[str, np.ndarray] = {}  # time key -> int32 [num_seqs], valid where seen

    def known(self, idx: np.ndarray) -> bool:
        """Whether every sequence of the batch was seen."""
        return bool(self.seen[idx].all())

    def lengths_of(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The noted int32 time lengths of the batch's sequences, per key (0: not noted)."""
        return {k: v[idx] for k, v in self.lengths.items()}

    def note_lengths(self, lengths: Mapping[str, np.ndarray]) -> None:
        """Note every sequence's lengths, read from the sequences themselves (not checked yet)."""
        for key, value in lengths.items():
            self.lengths[key] = np.asarray(value, dtype=np.int32).copy()

    def record(self, idx: np.ndarray, fields: Mapping[str, Field]) -> None:
        """Note a fully checked batch of whole sequences (no chunks)."""
        for key, field in fields.items():
            if field.lengths is not None:
                noted = self.lengths.get(key)
                if noted is None:
                    noted = self.lengths[key] = np.zeros(len(self.seen), dtype=np.int32)
                noted[idx] = field.lengths.numpy()
        self.seen[idx] = True
