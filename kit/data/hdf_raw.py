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
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int | None = None
    chunks: tuple[int, ...] = ()
    chunk_offsets: np.ndarray | None = None
    in_order: np.ndarray | None = None

    @property
    def chunk_bytes(self) -> int:
        return int(np.prod(self.chunks, dtype=np.int64)) * self.dtype.itemsize

    @property
    def row_elems(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))


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
    out = np.empty((b - a, *layout.shape[1:]), dtype=layout.dtype)
    if b <= a:
        return out
    if layout.offset is not None:
        files.read_into(path, stamp, out, layout.offset + a * layout.row_elems * layout.dtype.itemsize)
        return out
    assert layout.chunk_offsets is not None and layout.in_order is not None
    rows = layout.chunks[0]
    r0, r1 = a // rows, (b - 1) // rows + 1
    grid = layout.chunk_offsets[r0:r1]
    if (grid < 0).any():
        return None
    chunk_bytes = layout.chunk_bytes
    if len(layout.chunks) == 1 and (len(grid) == 1 or bool((np.diff(grid[:, 0]) == chunk_bytes).all())):
        # 1-D chunks one after the other in the file: the rows are one run of bytes
        files.read_into(path, stamp, out, int(grid[0, 0]) + (a - r0 * rows) * layout.dtype.itemsize)
        return out
    lo, hi = int(grid.min()), int(grid.max()) + chunk_bytes
    if hi - lo <= SPAN_SLACK * grid.size * chunk_bytes:  # the chunks lie together: one read for all
        data = np.empty(hi - lo, dtype=np.uint8)
        files.read_into(path, stamp, data, lo)
        in_order = layout.in_order[r0:r1]
    else:  # far apart: each chunk read on its own, into one buffer where each row's lie in order
        data, lo = np.empty(grid.size * chunk_bytes, dtype=np.uint8), 0
        for k, o in enumerate(grid.ravel()):
            files.read_into(path, stamp, data[k * chunk_bytes : (k + 1) * chunk_bytes], int(o))
        grid = np.arange(grid.size, dtype=np.int64).reshape(grid.shape) * chunk_bytes
        in_order = np.ones(len(grid), dtype=bool)
    for i in range(r1 - r0):
        start = (r0 + i) * rows
        src = slice(max(a - start, 0), min(b - start, rows))
        dst = out[start + src.start - a : start + src.stop - a]
        _copy_chunk_row(dst, data, grid[i] - lo, bool(in_order[i]), src, layout)
    return out


def _copy_chunk_row(dst: np.ndarray, data: np.ndarray, offsets: np.ndarray, in_order: bool, src: slice,
                    layout: RawLayout) -> None:
    """Copy rows ``src`` of one row of chunks (at ``offsets`` in ``data``, left to right) into ``dst``."""
    rows, cols = layout.chunks[0], (layout.chunks[1] if len(layout.chunks) > 1 else 1)
    chunk_bytes = layout.chunk_bytes
    width = layout.shape[1] if len(layout.shape) > 1 else 1
    flat = dst.reshape(len(dst), width)
    n = len(offsets)
    if in_order and width == n * cols:
        # the row's chunks one after the other, as written: one copy of [chunk, row, col] into [row, chunk, col]
        first = int(offsets[0])
        blocks = data[first : first + n * chunk_bytes].view(layout.dtype).reshape(n, rows, cols)
        flat.reshape(len(dst), n, cols)[:] = blocks.transpose(1, 0, 2)[src]
        return
    for j, o in enumerate(offsets):
        block = data[int(o) : int(o) + chunk_bytes].view(layout.dtype).reshape(rows, cols)
        c_hi = min((j + 1) * cols, width) - j * cols
        flat[:, j * cols : j * cols + c_hi] = block[src, :c_hi]
