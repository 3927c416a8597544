"""What the batch loader learns about each sequence the first time it loads it.

A dataset read through ``get_seq`` (or a torch dataset's items) is checked in full in the
first batch that holds a sequence: each declared key's arrays one dtype, the declared
layout, an accepted dtype kind, the label range. Its time lengths are noted then. Later
batches of sequences seen before take the lengths from the notes instead of from every
array, and skip the per-array dtype comparison; the checks that cost O(1) per key (the
joined array's layout and dtype kind, its frames against the noted lengths, the label
range) still run on every batch.

A dataset whose sequences change between epochs says so through ``Dataset.init_epoch``;
the pipeline then starts over with a new loader, and so with a new :class:`FirstSight`.
If a batch breaks what was noted (a declared key with two dtypes), the notes are dropped
for good and every batch is checked in full, as without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import numpy as np

from kit.data.batch import Field


def all_plain(items: list[Any]) -> bool:
    """Whether every item is a non-empty dict with str keys (as the dataset's check would return it)."""
    if not items or set(map(type, items)) != {dict} or not all(items):
        return False
    return all(type(k) is str for k in set(chain.from_iterable(items)))


class FirstSight:
    """Which sequences were checked, their time length per key, and whether the notes hold."""

    def __init__(self, num_seqs: int):
        self.seen = np.zeros(num_seqs, dtype=bool)
        self.lengths: dict[str, np.ndarray] = {}  # time key -> int32 [num_seqs], valid where seen
        self.dtypes: dict[str, Any] = {}  # declared key -> the one dtype its arrays had so far
        self.trusted = True  # False: some batch broke the notes, check everything every time

    def known(self, idx: np.ndarray) -> bool:
        """Whether every sequence of the batch was seen and the notes still hold."""
        return self.trusted and bool(self.seen[idx].all())

    def lengths_of(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The noted int32 time lengths of the batch's sequences, per key."""
        return {k: v[idx] for k, v in self.lengths.items()}

    def record(self, idx: np.ndarray, fields: Mapping[str, Field], dtypes: Mapping[str, Any]) -> None:
        """Note a fully checked batch of whole sequences (no chunks); ``dtypes``: per declared key,
        the one dtype of its arrays in this batch, None when they differed."""
        if not self.trusted:
            return
        if any(d is None or self.dtypes.setdefault(k, d) != d for k, d in dtypes.items()):
            self.trusted = False  # mixed dtypes are cast array by array: only the full check does that
            self.lengths.clear()
            return
        for key, field in fields.items():
            if field.lengths is not None:
                noted = self.lengths.get(key)
                if noted is None:
                    noted = self.lengths[key] = np.zeros(len(self.seen), dtype=np.int32)
                noted[idx] = field.lengths.numpy()
        self.seen[idx] = True
