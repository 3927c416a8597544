"""RETURNN's ``shuffle_frames_of_nseqs``: the frames of each group of n sequences permuted among them.

RETURNN (``Dataset.load_seqs`` with ``CachedDataset._shuffle_frames_in_seqs``) takes the sequences of
an epoch's order in aligned groups of n (positions ``[g*n, g*n + n)``), concatenates their frames in
that order, permutes them with ``numpy.random.RandomState(g*n).permutation(num_frames)`` and hands
each sequence back its own number of frames: lengths stay, the frames of a group are mixed (for
frame-wise training of feed-forward models). kit does the same here, as a pure function of the
epoch's order: a group is always permuted as a whole, whatever the prefetch thread, a resumed
position or chunking read first. kit's last group takes the sequences left (fewer than n), and the
other keys (frame-aligned targets) get the same permutation as ``data``.

Where RETURNN 1.20261022 differs (measured on its HDFDataset, the only class that shuffles): with
``cache_byte_size`` 0 (its default) ``load_seqs`` fails an assertion; with a cache too small for all
the data its preload thread fails an assertion (the frames stay as in the file); when n does not divide the sequence count its
preload thread fails (``end <= num_seqs``) and ``load_seqs`` then waits forever; with any target key
its target permutation raises a TypeError in the preload thread (``self._seq_start[idx]``, a vector,
as a slice bound), after permuting only the first group's ``data``; its preload thread marks
sequences loaded before it permutes them, so a read right after ``init_seq_order`` can get the
file's frames; and a fully cached epoch keeps the frames it permuted in the first epoch its process
loaded, by that epoch's groups, for all later epochs (a resumed run sees other frames than an
unbroken one). With the cache on and large enough, data only and n dividing the count, kit's frames
equal RETURNN's bitwise in its first epoch (and in later ones under a fixed order).

>>> fs = FrameShuffle(np.array([2, 0, 1]), 2)   # groups (2, 0) and (1,)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kit.errors import ConfigError, DataError

SeqDict = dict[str, np.ndarray]

CACHED_GROUPS = 4  # permuted groups kept: the batches of one epoch read a group's sequences one after another


def check_group_size(value: Any, where: str) -> int:
    """``shuffle_frames_of_nseqs`` as an int >= 0 (ConfigError naming the option if not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{where}: shuffle_frames_of_nseqs must be an int >= 0, got {value!r}")
    return int(value)


def check_frame_aligned(lengths: Mapping[str, np.ndarray], where: str) -> None:
    """Every key as long as ``data`` in every sequence: frames can only be permuted together then.

    RETURNN permutes ``data`` and means to permute its targets alike (its 1.20261022 fails on any
    target key: a TypeError in its preload thread); keys of other lengths cannot follow one permutation.
    """
    if "data" not in lengths:
        raise DataError(f"{where}: shuffle_frames_of_nseqs permutes the frames of 'data', and there is no 'data' key "
                        f"(keys: {sorted(lengths)})")
    data = np.asarray(lengths["data"])
    for key, lens in lengths.items():
        bad = np.flatnonzero(np.asarray(lens) != data)
        if len(bad):
            i = int(bad[0])
            raise DataError(
                f"{where}: shuffle_frames_of_nseqs needs every key frame-aligned with 'data', but key {key!r} of "
                f"sequence {i} has {int(lens[i])} frames and 'data' {int(data[i])} ({len(bad)} sequences differ); "
                f"set shuffle_frames_of_nseqs = 0 for this dataset"
            )


class FrameShuffle:
    """One epoch's frame groups: sequence ``order[p]`` is in the group starting at ``p - p % n``."""

    def __init__(self, order: Any, n: int):
        self.order = np.asarray(order, dtype=np.int64)
        self.n = n
        # dataset index -> position in the order (-1: not in this epoch), one int64 per sequence
        self._pos = np.full(int(self.order.max()) + 1 if len(self.order) else 0, -1, dtype=np.int64)
        self._pos[self.order] = np.arange(len(self.order), dtype=np.int64)
        self._cache: OrderedDict[int, dict[int, SeqDict]] = OrderedDict()

    def without_cache(self) -> FrameShuffle:
        """The same groups with no permuted frames held (what a worker process gets)."""
        return FrameShuffle(self.order, self.n)

    def covers(self, idx: int) -> bool:
        """Whether sequence ``idx`` is in this epoch's order."""
        return 0 <= idx < len(self._pos) and bool(self._pos[idx] >= 0)

    def group_start(self, idx: int) -> int:
        """The position in the epoch's order where sequence ``idx``'s group starts (RETURNN's seed)."""
        p = int(self._pos[idx])
        return p - p % self.n

    def seq(self, idx: int, read: Callable[[int], SeqDict]) -> SeqDict:
        """Sequence ``idx`` with its share of its group's permuted frames (``read(i)``: sequence i unshuffled)."""
        start = self.group_start(idx)
        group = self._cache.get(start)
        if group is None:
            group = self._cache[start] = self._permute(start, read)
            while len(self._cache) > CACHED_GROUPS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(start)
        return dict(group[idx])

    def _permute(self, start: int, read: Callable[[int], SeqDict]) -> dict[int, SeqDict]:
        members = self.order[start : start + self.n].tolist()
        seqs = [read(i) for i in members]
        lens = [int(s["data"].shape[0]) for s in seqs]
        cuts = np.cumsum(lens)[:-1]
        perm = np.random.RandomState(start).permutation(sum(lens))
        out: dict[int, SeqDict] = {i: {} for i in members}
        for key in seqs[0]:
            if np.ndim(seqs[0][key]) == 0:
                for i, s in zip(members, seqs):
                    out[i][key] = s[key]
                continue
            frames = np.concatenate([s[key] for s in seqs], axis=0)
            if frames.shape[0] != len(perm):
                raise DataError(f"shuffle_frames_of_nseqs: key {key!r} has {frames.shape[0]} frames in the group at "
                                f"position {start}, 'data' {len(perm)}: the keys are not frame-aligned")
            for i, part in zip(members, np.split(frames[perm], cuts)):
                out[i][key] = part
        return out
