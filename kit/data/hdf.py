"""``HDFDataset``: RETURNN's HDF files (``SimpleHDFWriter``, ``HDFDatasetWriter``, ``hdf_dump``), read lazily.

RETURNN's layout: ``inputs`` (the ``data`` key, all sequences concatenated in time),
``targets/data/<key>`` (the other keys, likewise), ``seqLengths`` ``[num_seqs, 1 + num_targets]``
(the ``inputs`` column first when there are inputs, then the target keys in sorted order),
``seqTags``, ``targets/size`` (dims) and ``targets/labels``. Only ``seqLengths`` is read at
start (a few bytes per sequence); each sequence's frames are read from the file when it is
loaded, so files far larger than memory train.

>>> ds = HDFDataset(["train.1.hdf", "train.2.hdf"], seq_ordering="laplace:.100")
>>> ds.get_seq(0)["data"].shape      # (T, dim), read from the file now
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kit.data.dataset import Dataset, SeqDict
from kit.data.frame_shuffle import FrameShuffle, check_frame_aligned, check_group_size
from kit.data.hdf_raw import RawFiles, RawLayout, Stamp, cheap_to_map, raw_layout, read_rows
from kit.data.hdf_write import write_hdf  # noqa: F401 - kit.data.hdf.write_hdf: the name users import
from kit.data.window import check_window, sliding_window
from kit.errors import ConfigError, DataError
from kit.fileio import check_regular_file

# what h5py raises on a damaged file (its own errors derive from these)
_H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError, OverflowError, AttributeError)


def _decode(tag: Any) -> str:
    text = tag.decode("utf-8") if isinstance(tag, bytes) else str(tag)
    return text.split("\0")[0]


MAX_INDEX_ENTRIES = 1 << 28  # seqLengths entries (2 GB as int64): more is not an index kit reads at start


class _FileIndex:
    """What is known of one file without reading its frames: keys, columns, per-sequence offsets.

    The index is checked against the file's own description (shapes of its datasets, read from the
    file's metadata, not its frames): lengths integer, >= 0 and summing to the rows of their key's
    data, as many tags as sequences, sizes and data present for each target key. A file that
    disagrees is a DataError naming the file, the key and the first bad sequence: never frames read
    from shifted offsets.
    """

    def __init__(self, path: str, fin: Any):
        self.path = path
        self.has_inputs = "inputs" in fin
        if "targets" in fin:
            for part, what in (("data", "the frames"), ("size", "the dims")):
                if f"targets/{part}" not in fin:
                    raise DataError(f"HDF file {path}: it has a 'targets' group but no 'targets/{part}' ({what} of "
                                    "the target keys); write it with RETURNN's HDF writers or kit.data.write_hdf")
            names = set(fin["targets/data"].keys()) | set(fin["targets/size"].attrs.keys())
            self.target_keys = sorted(str(k) for k in names)
            if missing := [k for k in self.target_keys if k not in fin["targets/data"]]:
                raise DataError(f"HDF file {path}: target key {missing[0]!r} has a size (targets/size) but no data "
                                f"(targets/data/{missing[0]})")
        else:
            self.target_keys = ["classes"]  # RETURNN's historical dummy column, never a data key
        self.lengths = _checked_lengths(path, fin["seqLengths"], ["data"] * self.has_inputs + self.target_keys)
        self.starts = np.zeros((len(self.lengths) + 1, self.lengths.shape[1]), dtype=np.int64)
        np.cumsum(self.lengths, axis=0, out=self.starts[1:])
        stored = set(fin["targets/data"].keys()) if "targets" in fin else set()
        self.data_keys = (["data"] if self.has_inputs else []) + [k for k in self.target_keys if k in stored]
        self._check_against_data(fin)
        # where each key's rows lie in the file, to read them without HDF5 (None: through h5py; a key not here yet
        # is mapped on its file's second read); see kit.data.hdf_raw
        self.stamp = Stamp.of_open(fin, path)
        self.raw: dict[str, RawLayout | None] = {}
        self.read_before = False  # a sequence of this file was read (large datasets are mapped from then on)
        for key in self.data_keys:
            if cheap_to_map(fin[self.dataset_name(key)]):
                self.raw[key] = raw_layout(fin[self.dataset_name(key)])

    def dataset_name(self, key: str) -> str:
        """The HDF dataset that holds ``key``'s rows."""
        return "inputs" if key == "data" and self.has_inputs else f"targets/data/{key}"

    def _check_against_data(self, fin: Any) -> None:
        for key in self.data_keys:
            name = self.dataset_name(key)
            ds = fin[name]
            if key != "data" and key not in fin["targets/size"].attrs:
                raise DataError(f"HDF file {self.path}: target key {key!r} has data but no size "
                                f"(targets/size has no attribute {key!r}: its dim is unknown)")
            if not ds.shape:
                raise DataError(f"HDF file {self.path}: {name} is a scalar, expected [frames, ...]")
            ends = self.starts[1:, self.column(key)]
            rows = int(ds.shape[0])
            if len(ends) and int(ends[-1]) != rows or not len(ends) and rows:
                over = np.flatnonzero(ends > rows)
                first = int(over[0]) if len(over) else len(ends) - 1
                total = int(ends[-1]) if len(ends) else 0
                raise DataError(
                    f"HDF file {self.path}: key {key!r}: seqLengths sum to {total} frames, but {name} has {rows} "
                    f"rows (first bad sequence: {first}); the file's index does not describe its data")
        if "seqTags" in fin:
            tags = fin["seqTags"]
            count = int(tags.shape[0]) if tags.shape else -1
            if count != len(self.lengths):
                raise DataError(
                    f"HDF file {self.path}: seqTags holds {count if count >= 0 else 'a scalar, not'} tags for "
                    f"{len(self.lengths)} sequences (first bad sequence: {min(max(count, 0), len(self.lengths))})")
    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    def column(self, key: str) -> int:
        if key == "data" and self.has_inputs:
            return 0
        return int(self.has_inputs) + self.target_keys.index(key)


MAX_OPEN_FILES = 16  # open h5py files kept per dataset (each holds HDF5's caches, ~0.5 MB); the rest reopen
CHUNK_CACHE_BYTES = 1 << 18  # HDF5's chunk cache per open dataset (its default is 1 MiB): sequences are read once


def _checked_lengths(path: str, ds: Any, keys: list[str]) -> np.ndarray:
    """``seqLengths`` as int64 ``[num_seqs, len(keys)]``; a DataError for any value that is not a frame count."""
    columns = len(keys)
    if ds.dtype.kind not in "iuf" or len(ds.shape) not in (1, 2):
        raise DataError(f"HDF file {path}: seqLengths is of type {ds.dtype} with shape {ds.shape}, expected "
                        f"integers [num_seqs, {columns}] (byte strings or other types are not lengths)")
    if int(np.prod(ds.shape, dtype=np.float64)) > MAX_INDEX_ENTRIES:
        raise DataError(f"HDF file {path}: seqLengths has shape {ds.shape}, more than {MAX_INDEX_ENTRIES} entries; "
                        "not a RETURNN HDF index")
    raw = np.asarray(ds[...])
    if raw.ndim == 1:
        raw = np.repeat(raw[:, None], columns, axis=1)
    if raw.shape[1] != columns:
        raise DataError(
            f"HDF file {path}: seqLengths has shape {raw.shape}, expected [num_seqs, {columns}] for the keys {keys}")
    if raw.dtype.kind == "f":
        bad = ~np.isfinite(raw) | (raw != np.floor(raw)) | (raw >= 2.0**62)
    else:
        bad = raw > np.iinfo(np.int64).max // 2 if raw.dtype.kind == "u" else np.zeros(raw.shape, dtype=bool)
    bad |= raw < 0
    if bad.any():
        s, c = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"HDF file {path}: key {keys[c]!r}: seqLengths of sequence {s} is {raw[s, c].item()!r}; "
                        "lengths must be integers >= 0")
    lengths = raw.astype(np.int64)
    if len(lengths) and int(lengths.max(initial=0)) > 0 and lengths.sum(axis=0, dtype=np.float64).max() >= 2.0**62:
        raise DataError(f"HDF file {path}: seqLengths sum to more than 2**62 frames")
    return lengths


class HDFDataset(Dataset):
    """RETURNN's ``HDFDataset``: one or more HDF files, read lazily.

    Frames stored plainly (no filters) are read straight from the file's bytes, at offsets h5py
    gives while the index is read (:mod:`kit.data.hdf_raw`); the rest through h5py, with at most
    ``MAX_OPEN_FILES`` files open at once (the least recently read is closed when another opens),
    so memory stays flat with the number of files. Reads are serialised by locks, so the
    pipeline's prefetch thread and the training thread may both read.

    Args:
        files: paths of the HDF files (their sequences follow each other in this order).
        use_cache_manager, cache_byte_size: RETURNN's caching options; kit always reads on
            demand, so ``cache_byte_size`` is accepted and has no effect, and a true
            ``use_cache_manager`` (RETURNN's cluster file cache) is refused.
        window: RETURNN's ``window`` (odd; the config key's value when the dict sets none): the
            ``inputs`` (key ``data``) as a sliding window over time, ``[T, D * window]``; needs dense inputs.
        shuffle_frames_of_nseqs: RETURNN's: in each epoch, the sequences of the epoch's order are taken in
            groups of this many and the frames of each group are permuted among its sequences (lengths kept);
            see :mod:`kit.data.frame_shuffle`. A pipeline's epoch sets the groups (``set_epoch_order``); before
            the first, ``get_seq`` gives the file's frames. 0 (the default): frames as in the file.
        **opts: the Dataset options (``seq_ordering``, ``partition_epoch``, ``fixed_random_seed``, ...).
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
        *,
        use_cache_manager: bool = False,
        cache_byte_size: int | None = None,
        window: int | None = None,
        shuffle_frames_of_nseqs: int = 0,
        **opts: Any,
    ):
        super().__init__(**opts)
        del cache_byte_size
        self.window = check_window(window, "HDFDataset")
        self.shuffle_frames_of_nseqs = check_group_size(shuffle_frames_of_nseqs, "HDFDataset")
        self._frames: FrameShuffle | None = None  # the epoch's frame groups (set_epoch_order), when shuffling
        if use_cache_manager:
            raise ConfigError("HDFDataset: use_cache_manager=True (RETURNN's cluster cache) is not supported by kit")
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise ConfigError("HDFDataset: 'files' is empty; give at least one HDF file")
        self._handles: OrderedDict[int, Any] = OrderedDict()  # the open files, least recently used first
        self._arrays: dict[int, dict[str, Any]] = {}  # per open file: its h5py dataset per data key (looked up once)
        self._lock = threading.RLock()
        self._raw = RawFiles()  # file descriptors for the rows read without HDF5
        try:
            self._open()
        except BaseException:
            self.close()  # HDF5 keeps an open file for its path: a fixed file must not be read through it
            raise
        if self.window > 1 and (not self._index[0].has_inputs or self.sparse["data"] or len(self.shapes["data"]) != 1):
            self.close()
            raise ConfigError(f"HDFDataset: window={self.window} needs dense [time, feature] inputs; {self.files[0]} "
                              f"has {'sparse ' if self._index[0].has_inputs else 'no '}inputs")
        if self.shuffle_frames_of_nseqs:
            try:
                check_frame_aligned(self.seq_lengths(), self.files[0])
            except DataError:
                self.close()
                raise

    def _open(self) -> None:
        self._index = [self._read_index(i) for i in range(len(self.files))]
        self.data_keys = self._index[0].data_keys
        for fi in self._index[1:]:
            if fi.data_keys != self.data_keys:
                raise DataError(
                    f"HDFDataset: {fi.path} has the keys {fi.data_keys}, but {self._index[0].path} has "
                    f"{self.data_keys}; all files of one HDFDataset need the same keys"
                )
        self._file_start = np.cumsum([0] + [fi.num_seqs for fi in self._index])
        self._tags: list[str] | None = None
        try:
            self.dims, self.shapes, self.sparse, self.labels = self._read_meta()
        except DataError:
            raise
        except _H5_ERRORS as exc:
            raise DataError(f"HDFDataset: {self.files[0]}: its sizes or labels cannot be read "
                            f"({type(exc).__name__}: {exc})") from None

    # ---- files -----------------------------------------------------------------------

    def _file(self, i: int) -> Any:
        """The open h5py file ``i`` (opened on use, the least recently used closed beyond ``MAX_OPEN_FILES``;
        not pickled: each worker opens its own). Call with ``self._lock`` held where a thread may read too."""
        fin = self._handles.get(i)
        if fin is not None:
            self._handles.move_to_end(i)
            return fin
        import h5py  # type: ignore[import-untyped]  # here: ``import kit`` must not load h5py

        while len(self._handles) >= MAX_OPEN_FILES:
            j, old = self._handles.popitem(last=False)
            self._arrays.pop(j, None)
            old.close()
        check_regular_file(self.files[i], "HDFDataset")
        try:
            fin = h5py.File(self.files[i], "r", rdcc_nbytes=CHUNK_CACHE_BYTES)
        except (OSError, ValueError, RuntimeError) as exc:
            raise DataError(f"HDFDataset: cannot open {self.files[i]}: {exc}") from None
        self._handles[i] = fin
        return fin

    def _read_index(self, i: int) -> _FileIndex:
        fin = self._file(i)
        try:
            if "seqLengths" not in fin:
                raise DataError(f"HDFDataset: {self.files[i]} is not a RETURNN HDF file (no 'seqLengths')")
            return _FileIndex(self.files[i], fin)
        except DataError:
            raise
        except _H5_ERRORS as exc:  # a damaged file: h5py raises from wherever its metadata breaks
            raise DataError(f"HDFDataset: {self.files[i]} is damaged ({type(exc).__name__}: {exc})") from None

    def _read_meta(
        self,
    ) -> tuple[dict[str, int], dict[str, tuple[int, ...]], dict[str, bool], dict[str, list[str]]]:
        fin, first = self._file(0), self._index[0]
        dims, shapes, sparse, labels = {}, {}, {}, {}
        for key in self.data_keys:
            ds = fin["inputs"] if key == "data" and first.has_inputs else fin["targets/data"][key]
            size = fin.attrs.get("inputPattSize") if key == "data" else fin["targets/size"].attrs.get(key)
            declared = np.ravel(size) if size is not None else np.array([ds.shape[-1] if ds.ndim > 1 else 1])
            dims[key] = int(declared[0])
            if dims[key] < 0 or declared.dtype.kind not in "iuf" or dims[key] != declared[0]:
                raise DataError(f"HDF file {self.files[0]}: the size of key {key!r} is {declared!r}, expected a dim >= 0")
            if ds.ndim == 1 and dims[key] == 0 and ds.shape[0] > 0:
                raise DataError(f"HDF file {self.files[0]}: key {key!r}: its size says dim 0, but it has labels")
            if ds.ndim > 1 and dims[key] != ds.shape[-1]:
                raise DataError(f"HDF file {self.files[0]}: key {key!r}: its size says dim {dims[key]}, but its data "
                                f"has {ds.shape[-1]} features per frame")
            shapes[key] = tuple(int(d) for d in ds.shape[1:])
            sparse[key] = ds.ndim == 1 and np.issubdtype(ds.dtype, np.integer)
        if "targets/labels" in fin:
            for key in fin["targets/labels"]:
                labels[str(key)] = [_decode(x) for x in fin["targets/labels"][key][...].tolist()]
        return dims, shapes, sparse, labels

    def close(self) -> None:
        """Close the open files (they reopen on the next read)."""
        with self._lock:
            for fin in self._handles.values():
                fin.close()
            self._handles.clear()
            self._arrays.clear()
        self._raw.close()

    @property
    def open_files(self) -> int:
        """How many of the files are open now (at most ``MAX_OPEN_FILES``)."""
        return len(self._handles)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"], state["_arrays"] = OrderedDict(), {}  # h5py files cannot be pickled; a worker reopens them
        del state["_raw"]  # nor file descriptors
        state["_frames"] = self._frames.without_cache() if self._frames is not None else None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._raw = RawFiles()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - interpreter shutdown: h5py may be gone already
            pass

    # ---- the Dataset protocol --------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return int(self._file_start[-1])

    def _locate(self, idx: int) -> tuple[int, int]:
        idx = self._check_index(idx)
        f = int(np.searchsorted(self._file_start, idx, side="right")) - 1
        return f, idx - int(self._file_start[f])

    def set_epoch_order(self, order: np.ndarray) -> bool:
        """With ``shuffle_frames_of_nseqs``: this epoch's frame groups are those of ``order``."""
        if not self.shuffle_frames_of_nseqs:
            return False
        with self._lock:
            self._frames = FrameShuffle(order, self.shuffle_frames_of_nseqs)
        return True

    def get_seq(self, idx: int) -> SeqDict:
        """Sequence ``idx``: its frames from the file, or (shuffling frames) its share of its group's permuted frames."""
        frames = self._frames
        if frames is None or not frames.covers(idx):
            return self._read_seq(idx)
        with self._lock:  # the prefetch thread and the training thread share the group cache
            return frames.seq(self._check_index(idx), self._read_seq)

    def _read_seq(self, idx: int) -> SeqDict:
        f, s = self._locate(idx)
        fi = self._index[f]
        out: SeqDict = {}
        for key in self.data_keys:
            c = fi.column(key)
            a, b = int(fi.starts[s, c]), int(fi.starts[s + 1, c])
            if key not in fi.raw and fi.read_before:
                self._map(f, key)
            layout = fi.raw.get(key)
            rows = read_rows(self._raw, fi.path, fi.stamp, layout, a, b) if layout is not None else None
            out[key] = rows if rows is not None else self._read_h5py(f, key, a, b, s)
        fi.read_before = True
        if self.window > 1:
            out["data"] = sliding_window(out["data"], self.window)
        return out

    def _map(self, f: int, key: str) -> None:
        """Where file ``f``'s rows of ``key`` lie. A large chunked dataset is mapped on its file's second read, the
        first going through h5py: an epoch's first batch, over files not read yet, does not wait for their maps
        (~10 ms for a file of 100 MB in 10 KB chunks), which the prefetch thread makes on later reads."""
        with self._lock:
            fi = self._index[f]
            if key not in fi.raw:
                try:
                    fi.raw[key] = raw_layout(self._arrays_of(f)[key])
                except _H5_ERRORS as exc:
                    raise DataError(f"HDF file {fi.path}: where key {key!r} lies cannot be read "
                                    f"({type(exc).__name__}: {exc})") from None

    def _read_h5py(self, f: int, key: str, a: int, b: int, s: int) -> np.ndarray:
        """Rows ``a:b`` of ``key`` in file ``f`` through h5py (sequence ``s`` of the file, for the error)."""
        with self._lock:
            try:
                return np.asarray(self._arrays_of(f)[key][a:b])
            except _H5_ERRORS as exc:
                raise DataError(f"HDF file {self._index[f].path}: key {key!r} of sequence {s} cannot be read "
                                f"({type(exc).__name__}: {exc})") from None

    def _arrays_of(self, f: int) -> dict[str, Any]:
        """File ``f``'s h5py dataset of each data key (opening the file when it is closed)."""
        fin = self._file(f)
        arrays = self._arrays.get(f)
        if arrays is None:
            fi = self._index[f]
            arrays = self._arrays[f] = {key: fin[fi.dataset_name(key)] for key in self.data_keys}
        return arrays

    def get_seq_tag(self, idx: int) -> str:
        if self._tags is not None:
            return self._tags[self._check_index(idx)]
        f, s = self._locate(idx)
        with self._lock:
            fin = self._file(f)
            try:
                return _decode(fin["seqTags"][s]) if "seqTags" in fin else f"seq-{idx}"
            except (*_H5_ERRORS, UnicodeDecodeError) as exc:
                raise DataError(f"HDF file {self.files[f]}: the tag of sequence {s} cannot be read ({exc})") from None

    def get_seq_index(self, tag: str) -> int:
        if self._tags is None:
            self._tags = self.all_tags()
        return super().get_seq_index(tag)

    def all_tags(self) -> list[str]:
        """Every sequence tag, in dataset order (one read of each file's ``seqTags``)."""
        tags: list[str] = []
        for f, fi in enumerate(self._index):
            with self._lock:
                fin = self._file(f)
                try:
                    stored = fin["seqTags"][...].tolist() if "seqTags" in fin else None
                except _H5_ERRORS as exc:
                    raise DataError(f"HDF file {fi.path}: seqTags cannot be read ({exc})") from None
            if stored is not None:
                try:
                    tags += [_decode(t) for t in stored]
                except UnicodeDecodeError as exc:
                    raise DataError(f"HDF file {fi.path}: seqTags cannot be read ({exc})") from None
            else:
                start = int(self._file_start[f])
                tags += [f"seq-{start + i}" for i in range(fi.num_seqs)]
        return tags

    def get_seq_length(self, idx: int) -> dict[str, int]:
        f, s = self._locate(idx)
        fi = self._index[f]
        return {key: int(fi.lengths[s, fi.column(key)]) for key in self.data_keys}

    def seq_lengths(self) -> dict[str, np.ndarray]:
        """All lengths from ``seqLengths`` alone (no frames read)."""
        return {
            key: np.concatenate([fi.lengths[:, fi.column(key)] for fi in self._index]) for key in self.data_keys
        }

    def sort_lengths(self) -> np.ndarray:
        """RETURNN sorts HDF sequences by the first ``seqLengths`` column (``inputs`` when present)."""
        return np.concatenate([fi.lengths[:, 0] for fi in self._index])

    @property
    def extern_data(self) -> dict[str, dict[str, Any]]:
        """A kit ``extern_data`` for these files: dense keys ``(None, dim)``, sparse ones ``sparse_dim``."""
        out: dict[str, dict[str, Any]] = {}
        for key in self.data_keys:
            if self.sparse[key]:
                out[key] = {"shape": (None,), "sparse_dim": self.dims[key]}
            else:
                out[key] = {"shape": (None, *self.shapes[key])}
        if self.window > 1:  # RETURNN's get_data_dim: input dim * window
            out["data"] = {"shape": (None, self.shapes["data"][0] * self.window)}
        return out
