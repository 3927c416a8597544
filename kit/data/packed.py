"""Packed storage: one data key of every sequence in one array, and batches gathered from it.

A dataset that holds its data this way offers it through ``Dataset.packed()`` (an opt-in:
the default returns None): per key, one array with all sequences' frames and each
sequence's start and length in it — :class:`ArrayDataset` of uniform sequences and
:class:`CharTextDataset` do; RETURNN's HDF files have the same layout. The batch loader
then pads a whole batch with a few numpy operations instead of a Python loop over its
sequences, and checks the layout against ``extern_data`` once per dataset instead of per
sequence and batch. Datasets without it are loaded through ``get_seq``, as always.

>>> pk = PackedKey.from_arrays([np.zeros((2, 3)), np.ones((4, 3))])
>>> pk.starts.tolist(), pk.lengths.tolist(), pk.seq(1).shape
([0, 2], [2, 4], (4, 3))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PackedKey:
    """One key of all sequences: ``data[starts[i] : starts[i] + lengths[i]]`` is sequence ``i``.

    Keys without a time axis have ``starts`` and ``lengths`` None and ``data[i]`` is
    sequence ``i``. Sequences may overlap or leave gaps (windows over one text, say).
    """

    data: np.ndarray
    starts: np.ndarray | None = None  # int64 [num_seqs]
    lengths: np.ndarray | None = None  # int64 [num_seqs]
    fixed_length: int | None = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        fixed = None  # every sequence this long (length-1 frames, fixed-size windows): no per-batch max
        if self.lengths is not None and len(self.lengths) and bool((self.lengths == self.lengths[0]).all()):
            fixed = int(self.lengths[0])
        object.__setattr__(self, "fixed_length", fixed)

    @property
    def has_time(self) -> bool:
        return self.starts is not None

    @property
    def num_seqs(self) -> int:
        return len(self.data) if self.lengths is None else len(self.lengths)

    def seq(self, i: int) -> np.ndarray:
        """Sequence ``i`` of this key (a view, no copy)."""
        if self.starts is None or self.lengths is None:
            return self.data[i]
        start = int(self.starts[i])
        return self.data[start : start + int(self.lengths[i])]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> PackedKey:
        """Concatenate (time keys, ``ndim >= 1``) or stack (0-dim) arrays of one dtype and layout."""
        if arrays[0].ndim == 0:
            return cls(np.stack(arrays))
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        return cls(np.concatenate(arrays), starts_of(lengths), lengths)


def starts_of(lengths: np.ndarray) -> np.ndarray:
    """Where each of back-to-back runs of these lengths starts (int64; the exclusive cumulative sum)."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def pack_seqs(seqs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, PackedKey] | None:
    """Every key packed, or None unless all sequences have the same keys and, per key, one
    dtype, rank and trailing shape (only then does one array per key hold them faithfully)."""
    if not seqs:
        return None
    keys = list(seqs[0])
    if any(len(s) != len(keys) for s in seqs):
        return None
    packed: dict[str, PackedKey] = {}
    for key in keys:
        try:
            arrays = [s[key] for s in seqs]
        except KeyError:
            return None
        first = arrays[0]
        layout = (first.dtype, first.ndim, first.shape[1:])
        if any((a.dtype, a.ndim, a.shape[1:]) != layout for a in arrays):
            return None
        pk = PackedKey.from_arrays(arrays)
        same = next((p for p in packed.values() if p.lengths is not None and pk.lengths is not None
                     and np.array_equal(p.lengths, pk.lengths)), None)
        if same is not None:  # keys of equal lengths share one layout: the loader computes it once per batch
            pk = PackedKey(pk.data, same.starts, same.lengths)
        packed[key] = pk
    return packed


def batch_layout(
    pk: PackedKey, idx: np.ndarray, spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(starts, lengths) of the batch's rows of a time key, chunk spans applied; (None, None) without time.

    ``spans``: (rows of the batch, start, end) relative to those rows' sequences.
    """
    if pk.starts is None or pk.lengths is None:
        return None, None
    starts, lengths = pk.starts[idx], pk.lengths[idx]  # fancy indexing: copies, safe to change
    if spans is not None:
        rows, start, end = spans
        starts[rows] += start
        lengths[rows] = end - start
    return starts, lengths


def fill_padded(
    out: np.ndarray,
    data: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    *,
    zero_padding: bool,
    full: bool | None = None,
) -> None:
    """``out[b, :lengths[b]] = data[starts[b] : starts[b] + lengths[b]]``, the rest zero when asked.

    ``full``: every row is ``out.shape[1]`` long (None: find out).
    """
    batch, time = out.shape[:2]
    if full is None:
        full = bool((lengths == time).all())
    if full:
        fill_full(out, data, starts)
        return
    pos = np.arange(time)
    if zero_padding:
        out.fill(0)
    if int(lengths.sum()) > LONG_ROWS * batch:  # long rows: a copy per row beats an index per frame
        for b, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            out[b, :n] = data[start : start + n]
        return
    mask = pos < lengths[:, None]
    out[mask] = data[(starts[:, None] + pos)[mask]]


def fill_full(out: np.ndarray, data: np.ndarray, starts: np.ndarray) -> None:
    """``out[b] = data[starts[b] : starts[b] + T]`` for rows that all have ``T = out.shape[1]`` frames."""
    batch, time = out.shape[:2]
    if time == 1:  # one frame per row: a gather of rows
        _take(data, starts, out.reshape(batch, *out.shape[2:]))
    else:  # no padding: one gather straight into out
        _take(data, starts[:, None] + np.arange(time), out)


LONG_ROWS = 12  # mean frames per row above which fill_padded copies row by row (measured crossover)


def fill_rows(out: np.ndarray, data: np.ndarray, idx: np.ndarray) -> None:
    """``out[b] = data[idx[b]]`` (keys without a time axis)."""
    _take(data, idx, out)


def _take(data: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    if data.dtype == out.dtype:
        data.take(index, axis=0, out=out, mode="clip")  # indices are in range; "clip" avoids a buffer
    else:
        out[...] = data[index]  # the declared dtype (same kind): cast on assignment
