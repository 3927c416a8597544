"""Reading an HDF dataset's rows straight from the file's bytes, where HDF5 stores them plainly.

An HDF5 dataset without filters (no compression, no checksum) keeps its elements in the file as
they are in memory: one block (contiguous layout) or fixed-size chunks at known offsets (chunked
layout, as RETURNN's ``SimpleHDFWriter`` writes them). h5py's public low-level API says where
(``DatasetID.get_offset``, ``DatasetID.chunk_iter``), once, while the file is open to read its
index. A sequence's rows are then one positional read (``os.preadv``) into a new array, with the
chunks copied out of it; no HDF5 file stays open for them.

Why: an open HDF5 file costs ~0.5 MB (HDF5's per-file caches), so a dataset of many files keeps
only a few open and reopens the others (~0.7 ms each, mostly holding the GIL, which the training
thread then waits for); and h5py's read path is a few dozen microseconds of Python per read. A
positional read releases the GIL and costs a file descriptor. The values are those h5py reads (the
dataset's own dtype and byte order; tested against h5py for both layouts). Anything else (filters,
external or virtual storage, compact layout, chunks never written, types that are not plain
numbers, a platform without ``os.preadv``) is read through h5py, as before.

A file whose size or modification time changed since its index was read, or that was replaced by
another (a new inode), is a ``DataError``: its offsets may no longer hold the rows the index promises.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kit.errors import DataError

MAX_CHUNKS = 1 << 20  # chunks mapped per dataset (8 bytes each); a dataset with more is read through h5py
SOON_CHUNKS = 4096  # a dataset with at most this many chunks is mapped while its file's index is read (~1 us a
# chunk); a larger one on its file's second read (mapping 1000 files of 100 MB at start would add seconds)
MAX_FDS = 64  # file descriptors kept open per dataset of files (no HDF5 state behind them); the rest reopen
SPAN_SLACK = 4  # one read covers a sequence's chunks when the bytes between them are at most this many times theirs


@dataclass(frozen=True)
class Stamp:
    """What identifies a file's contents as those its index was read from."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> Stamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)

    @classmethod
    def of_open(cls, fin: Any, path: str) -> Stamp:
        """The stamp of the file h5py file ``fin`` has open (its descriptor, so a file replaced at ``path`` since
        cannot stand in for it); the path's where HDF5's driver has no descriptor."""
        try:
            return cls.of(os.fstat(int(fin.id.get_vfd_handle())))
        except (OSError, ValueError, TypeError, RuntimeError):
            return cls.of(os.stat(path))


@dataclass
class RawLayout:
    """Where one dataset's elements lie in its file, with their type and the dataset's shape.

    Contiguous: ``offset``. Chunked: ``chunks`` (the chunk shape, 1-D or 2-D), ``chunk_offsets`` (by chunk grid
    position, ``[row of chunks, column of chunks]``, -1 where a chunk was never written) and ``in_order``
    (per row of chunks: they lie one after the other in the file, left to right, as a writer appends them).
    ``run_start`` (derived, per row of chunks ``r``): the first row of chunks of the run that ends at ``r``, rows in
    order whose chunks follow one another in the file (``r + 1`` where row ``r`` is not in order): rows ``r0:r1``
    are one run of bytes when ``run_start[r1 - 1] <= r0``, a sequence's read checks no more than that.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int | None = None
    chunks: tuple[int, ...] = ()
    chunk_offsets: np.ndarray | None = None
    in_order: np.ndarray | None = None

    def __post_init__(self) -> None:
        # plain ints, computed once: a sequence's read uses them several times
        self.width = int(np.prod(self.shape[1:], dtype=np.int64))  # elements per row
        self.row_bytes = self.width * self.dtype.itemsize
        self.chunk_bytes = int(np.prod(self.chunks, dtype=np.int64)) * self.dtype.itemsize
        self.chunk_rows = self.chunks[0] if self.chunks else 0
        self.chunk_cols = self.chunks[1] if len(self.chunks) > 1 else 1
        self.run_start = np.zeros(0, dtype=np.int64)
        if self.chunk_offsets is not None and self.in_order is not None:
            offsets, good = self.chunk_offsets, self.in_order
            rows = np.arange(len(offsets), dtype=np.int64)
            follows = np.zeros(len(offsets), dtype=bool)
            follows[1:] = good[1:] & good[:-1] & (offsets[1:, 0] == offsets[:-1, -1] + self.chunk_bytes)
            self.run_start = np.maximum.accumulate(np.where(follows, 0, rows))
            self.run_start[~good] = rows[~good] + 1


def cheap_to_map(ds: Any) -> bool:
    """Whether mapping ``ds`` costs little (contiguous, or at most ``SOON_CHUNKS`` chunks)."""
    return ds.chunks is None or int(ds.id.get_num_chunks()) <= SOON_CHUNKS


def raw_layout(ds: Any) -> RawLayout | None:
    """The raw layout of h5py dataset ``ds``, or None when its rows must be read through h5py."""
    import h5py  # type: ignore[import-untyped]

    if not hasattr(os, "preadv") or ds.dtype.kind not in "iuf" or ds.ndim == 0:
        return None
    plist = ds.id.get_create_plist()
    if plist.get_nfilters() != 0 or plist.get_external_count() != 0:
        return None
    layout, dtype, shape = plist.get_layout(), np.dtype(ds.dtype), tuple(int(d) for d in ds.shape)
    if layout == h5py.h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        return RawLayout(dtype, shape, offset=int(offset)) if offset is not None else None
    if layout != h5py.h5d.CHUNKED or ds.ndim > 2 or not hasattr(ds.id, "chunk_iter"):
        return None
    chunks = tuple(int(c) for c in ds.chunks)
    grid = tuple(-(-n // c) for n, c in zip(shape, chunks))
    if int(np.prod(grid, dtype=np.int64)) > MAX_CHUNKS:
        return None
    found: list[tuple[tuple[int, ...], int, int, int]] = []
    ds.id.chunk_iter(lambda info: found.append((info.chunk_offset, info.byte_offset, info.size, info.filter_mask)))
    chunk_bytes = int(np.prod(chunks, dtype=np.int64)) * dtype.itemsize
    offsets = np.full(grid, -1, dtype=np.int64)
    if found:
        where, byte_offset, size, mask = (np.array(column, dtype=np.int64) for column in zip(*found))
        if (size != chunk_bytes).any() or (mask != 0).any():
            return None
        offsets[tuple((where // np.array(chunks)).T)] = byte_offset
    offsets = offsets.reshape(grid[0], -1)
    in_order = (np.diff(offsets, axis=1) == chunk_bytes).all(axis=1) & (offsets >= 0).all(axis=1)
    return RawLayout(dtype, shape, chunks=chunks, chunk_offsets=offsets, in_order=in_order)


class RawFiles:
    """Positional reads from a set of files, at most ``MAX_FDS`` open (least recently used closed first).

    Each file is checked against the :class:`Stamp` taken with its index when it is (re)opened.
    """

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _fd(self, path: str, stamp: Stamp) -> int:
        """The open descriptor of ``path`` (opened and checked against ``stamp`` when it is not); lock held."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        while len(self._fds) >= MAX_FDS:
            os.close(self._fds.popitem(last=False)[1])
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise DataError(f"HDF file {path}: cannot be opened again to read its frames ({exc})") from None
        now = Stamp.of(os.fstat(fd))
        if now != stamp:
            os.close(fd)
            raise DataError(f"HDF file {path} changed since its index was read (size {stamp.size} -> {now.size}, "
                            "or its modification time): open the dataset again")
        self._fds[path] = fd
        return fd

    def read_into(self, path: str, stamp: Stamp, out: np.ndarray, offset: int) -> None:
        """Fill ``out`` (C-contiguous) with the file's bytes from ``offset``. The lock is held through the read
        (the GIL is not): a descriptor closed meanwhile could be reused for another file."""
        view = out.data.cast("B")
        done = 0
        with self._lock:
            fd = self._fd(path, stamp)
            while done < view.nbytes:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise DataError(f"HDF file {path}: ends at byte {offset + done}, before the {view.nbytes} bytes "
                                    f"of rows at {offset} its index names (the file was cut short)")
                done += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_rows(files: RawFiles, path: str, stamp: Stamp, layout: RawLayout, a: int, b: int) -> np.ndarray | None:
    """Rows ``a:b`` of the dataset (as h5py's ``ds[a:b]`` gives them), or None when a chunk of them was never
    written (h5py fills it in)."""
    if layout.offset is not None or b <= a:
        out = np.empty((max(b - a, 0), *layout.shape[1:]), dtype=layout.dtype)
        if b > a:
            files.read_into(path, stamp, out, layout.offset + a * layout.row_bytes)  # type: ignore[operator]
        return out
    assert layout.chunk_offsets is not None
    rows, chunk_bytes = layout.chunk_rows, layout.chunk_bytes
    r0, r1 = a // rows, (b - 1) // rows + 1
    # the rows of chunks r0..r1 whole, [rows of chunks * chunk rows, columns of chunks * chunk columns];
    # the sequence's rows are a view of it (the base is at most two rows of chunks larger)
    n = layout.chunk_offsets.shape[1]
    whole = np.empty(((r1 - r0) * rows, n * layout.chunk_cols), dtype=layout.dtype)
    if int(layout.run_start[r1 - 1]) <= r0:
        # as a writer appends them: the chunks one after the other, row by row, left to right
        lo = int(layout.chunk_offsets[r0, 0])
        if n == 1:  # chunks as wide as a row: the bytes are the rows
            files.read_into(path, stamp, whole, lo)
        else:  # one read, one copy of [row of chunks, chunk, row, col] into [row of chunks, row, chunk, col]
            data = np.empty((r1 - r0) * n * chunk_bytes, dtype=np.uint8)
            files.read_into(path, stamp, data, lo)
            _transpose_into(whole, data.view(layout.dtype), r1 - r0, n, layout)
    elif (layout.chunk_offsets[r0:r1] < 0).any():
        return None
    else:
        _read_scattered(files, path, stamp, layout, r0, r1, whole)
    got = whole[a - r0 * rows : b - r0 * rows, : layout.width]
    if not got.flags.c_contiguous:  # chunks that overhang the width: a C-ordered array, as h5py gives it
        got = np.ascontiguousarray(got)
    return got.reshape(b - a, *layout.shape[1:])


def _transpose_into(whole: np.ndarray, elems: np.ndarray, k: int, n: int, layout: RawLayout) -> None:
    """``k`` rows of ``n`` chunks each, in this order in ``elems``, into ``whole`` ([k * rows, n * cols])."""
    rows, cols = layout.chunk_rows, layout.chunk_cols
    whole.reshape(k, rows, n, cols)[:] = elems.reshape(k, n, rows, cols).transpose(0, 2, 1, 3)


def _read_scattered(files: RawFiles, path: str, stamp: Stamp, layout: RawLayout, r0: int, r1: int,
                    whole: np.ndarray) -> None:
    """Rows of chunks ``r0:r1``, not one after the other in the file, into ``whole``: one read over all when they
    lie together, else each chunk read on its own; each row of chunks in order is copied at once."""
    assert layout.chunk_offsets is not None and layout.in_order is not None
    chunk_bytes, rows, cols = layout.chunk_bytes, layout.chunk_rows, layout.chunk_cols
    grid, k = layout.chunk_offsets[r0:r1], r1 - r0
    n = grid.shape[1]
    lo, hi = int(grid.min()), int(grid.max()) + chunk_bytes
    if hi - lo <= SPAN_SLACK * grid.size * chunk_bytes:  # the chunks lie together: one read for all
        data = np.empty(hi - lo, dtype=np.uint8)
        files.read_into(path, stamp, data, lo)
        offsets, in_order = grid - lo, layout.in_order[r0:r1]
    else:  # far apart: each chunk read on its own, into one buffer where they lie in order
        data = np.empty(grid.size * chunk_bytes, dtype=np.uint8)
        for j, o in enumerate(grid.ravel().tolist()):
            files.read_into(path, stamp, data[j * chunk_bytes : (j + 1) * chunk_bytes], o)
        offsets, in_order = np.arange(grid.size, dtype=np.int64).reshape(grid.shape) * chunk_bytes, np.ones(k, bool)
    out = whole.reshape(k, rows, n, cols)
    for i in range(k):
        first = int(offsets[i, 0])
        if in_order[i]:
            _transpose_into(out[i], data[first : first + n * chunk_bytes].view(layout.dtype), 1, n, layout)
            continue
        for j, o in enumerate(offsets[i].tolist()):
            out[i, :, j] = data[o : o + chunk_bytes].view(layout.dtype).reshape(rows, cols)

