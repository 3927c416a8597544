"""Consecutive planned batches of a packed dataset gathered in one go: one array per key for all.

Gathering batch by batch (:class:`~kit.data.gather.PackedGather`) costs a few dozen numpy and
Python calls per batch — ~50 µs for 64 length-1 sequences, more than a small model's step
leaves to spare. For the batches :mod:`kit.data.ahead` loads together, each key of the whole
block is gathered with one index into one zero-padded array, the lengths and masks are built
for all batches at once, and each batch gets views of these arrays (one ``split`` per array).

The batches are exactly those gathered one by one (same shapes, dtypes, values, padding).
A batch that is kept keeps its block's arrays alive (at most ``kit.data.ahead.MAX_BYTES``
plus the last batch). The arrays are carved from buffers that are used again once no
tensor of theirs is alive (:class:`BlockMemory`): a fresh 2 MB block costs the kernel's page
faults (~2 per batch of 64 length-1 sequences), a buffer used again is resident.

Where a block does not pay or cannot be exact — chunk spans, labels that some batch must
check and name, long rows (a copy per row beats an index per frame) — :func:`gather_block`
returns None and the batches are gathered one by one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kit.data import packed as packing
from kit.data.batch import Field
from kit.data.batching import EpochEntries
from kit.data.gather import KeyPlan, PackedGather


@dataclass
class _Block:
    """The block's sequences, batch after batch: ``idx[seq_off[b] : seq_off[b + 1]]`` is batch ``b``."""

    idx: np.ndarray  # int64 [N]
    num_seqs: np.ndarray  # int64 [k]: sequences per batch
    seq_off: np.ndarray  # int64 [k]: first sequence of each batch in ``idx``


@dataclass
class _TimeLayout:
    """Where a time key's frames go in the block's flat ``[frames, ...]`` array."""

    time: np.ndarray  # int64 [k]: each batch's padded length
    lengths: np.ndarray  # int64 [N]: each sequence's length
    src: np.ndarray | None = None  # frame indices into the packed data (None: whole rows, see gather)
    dst: np.ndarray | None = None  # their positions in the flat array (None: no padding anywhere)


def gather_block(
    gather: PackedGather, entries: EpochEntries, ranges: Sequence[tuple[int, int]], start: int,
    max_batches: int, max_bytes: int, memory: BlockMemory | None = None,
) -> list[dict[str, Field]] | None:
    """The fields of batches ``start, start + 1, ...``: the first always, the next while the bytes
    before them stay under ``max_bytes`` (at most ``max_batches``, never past the plan's end).
    None when a block does not apply; then the caller gathers batch by batch."""
    if entries.spans or any(kp.check_labels for kp in gather.keys):
        return None
    block = _block(entries, ranges, start, min(len(ranges), start + max_batches))
    if block is None:
        return None
    layouts = _time_layouts(gather.keys, block)
    if layouts is None:
        return None
    k = _fitting(gather.keys, block, layouts, max_bytes)
    if k < len(block.num_seqs):  # fewer batches than planned: the block's first k
        block = _block(entries, ranges, start, start + k)
        assert block is not None
        layouts = _time_layouts(gather.keys, block)
        assert layouts is not None
    carver = (memory or BlockMemory(keep=0)).carver()
    fields = _fields(gather.keys, block, layouts, carver)
    if memory is not None:
        memory.used(carver)
    return fields


class BlockMemory:
    """Buffers that blocks' arrays are carved from, each used again once no array carved from it
    is alive (no batch of its block is left): CPython's reference count of the buffer says so,
    since every carved array, and every tensor over one, holds a reference to it."""

    _UNUSED = 3  # references to a buffer nobody views: the list, the loop variable, getrefcount's argument

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._buffers: list[np.ndarray] = []
        self._want = 0  # bytes the largest block so far used

    def carver(self) -> _Carver:
        """Arrays for the next block, from a buffer nobody views any more (a new one if none is)."""
        buffer = None
        for buf in self._buffers:
            if buf.nbytes >= self._want and sys.getrefcount(buf) <= self._UNUSED:
                buffer = buf
                break
        if buffer is None and self.keep and self._want:
            buffer = np.empty(self._want + _ALIGN, np.uint8)
            self._buffers.append(buffer)
            if len(self._buffers) > self.keep:  # the oldest goes: freed once its batches are
                self._buffers.pop(0)
        return _Carver(buffer)

    def used(self, carver: _Carver) -> None:
        self._want = max(self._want, carver.total)


_ALIGN = 64  # bytes: every carved array starts at a multiple (as torch's own allocations do)


class _Carver:
    """One block's arrays, one after the other in ``buffer`` while they fit, else allocated on their own."""

    def __init__(self, buffer: np.ndarray | None):
        self.buffer = buffer
        address = 0 if buffer is None else buffer.__array_interface__["data"][0]  # numpy's array interface
        self.offset = -address % _ALIGN
        self.total = 0  # bytes asked for, aligned: what the next block's buffer should hold

    def array(self, shape: tuple[int, ...], dtype: np.dtype, *, zero: bool) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = -(-nbytes // _ALIGN) * _ALIGN
        self.total += size
        buf = self.buffer
        if buf is None or self.offset + nbytes > buf.nbytes:
            return np.zeros(shape, dtype) if zero else np.empty(shape, dtype)
        out = buf[self.offset : self.offset + nbytes].view(dtype).reshape(shape)
        self.offset += size
        if zero:
            out.fill(0)
        return out


def _block(entries: EpochEntries, ranges: Sequence[tuple[int, int]], start: int, stop: int) -> _Block | None:
    bounds = np.array(ranges[start:stop], dtype=np.int64).reshape(-1, 2)
    num_seqs = bounds[:, 1] - bounds[:, 0]
    if not len(num_seqs) or not num_seqs.all():
        return None
    seq_off = packing.starts_of(num_seqs)
    # the entries of the batches, in batch order (consecutive unless the batches were shuffled)
    pos = np.arange(int(num_seqs.sum()), dtype=np.int64) + np.repeat(bounds[:, 0] - seq_off, num_seqs)
    return _Block(entries.seq_idx[pos], num_seqs, seq_off)


def _time_layouts(keys: list[KeyPlan], block: _Block) -> dict[tuple[int, int], _TimeLayout] | None:
    """One layout per distinct (starts, lengths) of the time keys; None when some key has long rows."""
    layouts: dict[tuple[int, int], _TimeLayout] = {}
    for kp in keys:
        pk = kp.pk
        if pk.starts is None or pk.lengths is None or (id(pk.starts), id(pk.lengths)) in layouts:
            continue
        if pk.fixed_length is not None:
            n = len(block.idx)
            layout = _TimeLayout(np.full(len(block.num_seqs), pk.fixed_length, np.int64),
                                 np.full(n, pk.fixed_length, np.int64))
        else:
            lengths = pk.lengths[block.idx]
            if lengths.sum() > packing.LONG_ROWS * len(lengths):
                return None
            layout = _padded_layout(pk.starts[block.idx], lengths, block)
        layouts[id(pk.starts), id(pk.lengths)] = layout
    return layouts


def _padded_layout(starts: np.ndarray, lengths: np.ndarray, block: _Block) -> _TimeLayout:
    """Frame by frame: source index in the packed data, position in the flat padded array."""
    time = np.maximum.reduceat(lengths, block.seq_off)
    seq_time = np.repeat(time, block.num_seqs)
    region_off = packing.starts_of(block.num_seqs * time)  # each batch's [B, T] region
    row_in_batch = np.arange(len(lengths), dtype=np.int64) - np.repeat(block.seq_off, block.num_seqs)
    row_start = np.repeat(region_off, block.num_seqs) + row_in_batch * seq_time
    frame = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(packing.starts_of(lengths), lengths)
    padded = bool((lengths != seq_time).any())
    dst = np.repeat(row_start, lengths) + frame if padded else None
    return _TimeLayout(time, lengths, np.repeat(starts, lengths) + frame, dst)


def _row_bytes(kp: KeyPlan) -> int:
    return int(np.prod(kp.pk.data.shape[1:], dtype=np.int64)) * kp.dtype.itemsize


def _fitting(keys: list[KeyPlan], block: _Block, layouts: dict[tuple[int, int], _TimeLayout], max_bytes: int) -> int:
    """How many of the block's batches to keep: a batch is loaded while the bytes before it are under
    ``max_bytes`` (tensors and lengths, as :func:`kit.data.ahead.batch_bytes` counts them)."""
    per_batch = np.zeros(len(block.num_seqs), dtype=np.int64)
    for kp in keys:
        layout = _layout_of(kp, layouts)
        if layout is None:
            per_batch += block.num_seqs * _row_bytes(kp)
        else:
            per_batch += block.num_seqs * (layout.time * _row_bytes(kp) + 4)
    before = np.cumsum(per_batch)[:-1]
    return 1 + int(np.searchsorted(before, max_bytes, side="left"))


def _layout_of(kp: KeyPlan, layouts: dict[tuple[int, int], _TimeLayout]) -> _TimeLayout | None:
    pk = kp.pk
    return None if pk.starts is None else layouts[id(pk.starts), id(pk.lengths)]


def _fields(
    keys: list[KeyPlan], block: _Block, layouts: dict[tuple[int, int], _TimeLayout], new: _Carver
) -> list[dict[str, Field]]:
    k, splits = len(block.num_seqs), block.num_seqs.tolist()
    fields: list[dict[str, Field]] = [{} for _ in range(k)]
    for kp in keys:
        sparse_dim = kp.spec.sparse_dim if kp.spec is not None else None
        layout = _layout_of(kp, layouts)
        if layout is None:  # no time axis: rows
            rows = new.array((len(block.idx), *kp.pk.data.shape[1:]), kp.dtype, zero=False)
            packing.fill_rows(rows, kp.pk.data, block.idx)
            for b, t in enumerate(_aligned(torch.from_numpy(rows).split(splits))):
                fields[b][kp.key] = Field(t, None, sparse_dim)
            continue
        tensors = _aligned(_time_tensors(kp, block, layout, new))
        lengths_array = new.array((len(block.idx),), np.dtype(np.int32), zero=False)
        lengths_array[:] = layout.lengths
        lengths = torch.from_numpy(lengths_array).split(splits)
        masks = _masks(block, layout, new)  # each key its own: a mask handed out is the caller's to change
        for b in range(k):
            f = Field(tensors[b], lengths[b], sparse_dim)
            f.prepare_mask(masks[b])
            fields[b][kp.key] = f
    return fields


_FLOAT_ALIGN = 16  # bytes: what malloc, numpy and so RETURNN's batches give (torch's own: 64)


def _aligned(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, each floating one whose data does not start on a 16-byte boundary copied to
    one that does. A batch's view into its block starts wherever the batches before it end, and
    on AVX-512 CPUs MKL's matrix products round differently for inputs that are not 16-byte
    aligned (the same Linear layer's output differs in the last bit between offsets 0 and 4
    bytes): without the copy, kit's losses drift from RETURNN's, and from kit's own batch-by-batch
    gathering, by an ulp. Integer and bool tensors take no such paths and stay views."""
    if not tensors or not tensors[0].is_floating_point():
        return list(tensors)
    return [t if t.data_ptr() % _FLOAT_ALIGN == 0 else t.clone() for t in tensors]


def _time_tensors(kp: KeyPlan, block: _Block, layout: _TimeLayout, new: _Carver) -> list[torch.Tensor]:
    """Each batch's ``[B, T, ...]`` tensor, views of one array."""
    pk, rest = kp.pk, kp.pk.data.shape[1:]
    if layout.src is None:  # one length: [N, L, ...] rows, whole or frame by frame
        length = int(layout.time[0])
        out = new.array((len(block.idx), length, *rest), kp.dtype, zero=False)
        if kp.rows is not None:
            packing.fill_rows(out, kp.rows, block.idx)
        else:
            assert pk.starts is not None
            packing.fill_full(out, pk.data, pk.starts[block.idx])
        return list(torch.from_numpy(out).split(block.num_seqs.tolist()))
    sizes = block.num_seqs * layout.time
    flat = new.array((int(sizes.sum()), *rest), kp.dtype, zero=layout.dst is not None)
    if layout.dst is None:
        packing.fill_rows(flat, pk.data, layout.src)
    else:
        flat[layout.dst] = pk.data[layout.src]
    return _views(torch.from_numpy(flat), block, layout, rest)


def _masks(block: _Block, layout: _TimeLayout, new: _Carver) -> list[torch.Tensor]:
    """Each batch's ``[B, T]`` bool mask (True on real frames), views of one array."""
    sizes = block.num_seqs * layout.time
    flat = new.array((int(sizes.sum()),), np.dtype(bool), zero=layout.dst is not None)
    if layout.dst is None:
        flat.fill(True)
    else:
        flat[layout.dst] = True
    return _views(torch.from_numpy(flat), block, layout, ())


def _views(flat: torch.Tensor, block: _Block, layout: _TimeLayout, rest: tuple[int, ...]) -> list[torch.Tensor]:
    """``flat`` (each batch's frames in turn) as each batch's ``[B, T, *rest]`` view. Where every batch
    has the same ``T``, one split of the ``[N, T, *rest]`` whole (a third of the host time of a split
    and a view per batch)."""
    times = layout.time.tolist()
    if len(set(times)) == 1 and times[0] > 0:
        return list(flat.view(-1, times[0], *rest).split(block.num_seqs.tolist()))
    parts = flat.split((block.num_seqs * layout.time).tolist())
    return [p.view(b, t, *rest) for p, b, t in zip(parts, block.num_seqs.tolist(), times)]
