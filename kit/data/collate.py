"""Load planned batches and collate them into a zero-padded :class:`kit.Batch`.

``BatchLoader`` is what travels to worker processes: the dataset and the parsed
``extern_data`` (what it learns while loading stays in each process). It must be picklable.

Per batch, each key costs a few numpy operations, not a Python loop over its sequences:
a dataset with packed storage (``Dataset.packed()``, see :mod:`kit.data.gather`) is
gathered straight into the padded arrays and checked against ``extern_data`` once;
any other dataset's sequences (``get_seq``) are concatenated per key, checked as a
whole, and padded, and each sequence is checked on its own the first time it is loaded
(:mod:`kit.data.first_sight`). When a batch check fails its sequences are checked one by
one, so that the error names the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from kit.data import packed as packing
from kit.data.batch import Batch, Field, StringField
from kit.data.batching import Entry, EpochEntries, PlannedBatch
from kit.data.block import BlockMemory, gather_block
from kit.data.dataset import TorchDataset, as_numpy
from kit.data.extern_data import DataSpec, ExternData, check_array, kind_ok, labels_in_range
from kit.data.first_sight import FirstSight, all_plain, plain_dicts
from kit.data.gather import PackedGather, allocate
from kit.errors import DataError

STRING_KINDS = "USO"  # numpy kinds of str, bytes and object arrays: a StringField each


class SeqTags(Sequence[str]):
    """The tags of a batch's sequences, each built when an error message asks for it."""

    def __init__(self, idxs: Sequence[int], tag_of: Callable[[int], str]):
        self.idxs, self.tag_of = idxs, tag_of

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.tag_of(j) for j in self.idxs[i]]
        return self.tag_of(self.idxs[i])

    def __len__(self) -> int:
        return len(self.idxs)


class BatchLoader:
    """Loads the sequences of one planned batch, cuts chunks, validates, pads.

    Keys declared in ``extern_data`` are validated and cast to the declared dtype;
    other keys the dataset provides are passed through as they are (time axis when the
    array has at least one dim). Without ``extern_data`` everything is inferred from the
    arrays. Sequences are checked in full the first time they are loaded (see
    :mod:`kit.data.first_sight`); a packed dataset is checked once as a whole.
    """

    def __init__(self, dataset: Any, extern_data: ExternData | None):
        self.dataset = dataset
        self.extern_data = extern_data
        self._reset()

    def _reset(self) -> None:
        self._packed: PackedGather | None | bool = False  # False: not asked yet
        self._block_memory = BlockMemory()  # the buffers the blocks of batches loaded ahead are carved from
        self._sight = FirstSight(len(self.dataset))
        # a TorchDataset as it comes: items of seen sequences are read straight from the wrapped dataset
        ds = self.dataset
        self._items: Callable[[int], Any] | None = None
        if isinstance(ds, TorchDataset) and type(ds).get_seq is TorchDataset.get_seq:
            if type(ds).get_item is TorchDataset.get_item and type(ds).check_item is TorchDataset.check_item:
                self._items = ds.dataset.__getitem__
        # lengths the dataset read from its items for the plan: as good as noted at first sight
        self._seed_lengths = isinstance(ds, TorchDataset) and self._items is not None and ds.lengths_from_items

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "extern_data": self.extern_data}  # a worker learns on its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset, self.extern_data = state["dataset"], state["extern_data"]
        self._reset()

    def load(self, entries: Sequence[Entry], idx: np.ndarray | None = None) -> Batch:
        """The batch of these plan entries, ``(seq_idx, spans)`` tuples (``idx``: accepted, not needed)."""
        return self.load_planned(PlannedBatch.from_entries(entries))

    def load_planned(self, batch: PlannedBatch) -> Batch:
        """The batch of one planned batch (what a worker gets)."""
        idxs = batch.idx.tolist()
        tag_of = self.dataset.get_seq_tag
        gather = self._packed_gather(batch.idx, tag_of)
        if gather is not None:
            fields = gather.gather(batch, torch.utils.data.get_worker_info() is not None)
        else:
            fields = self._collate_seqs(batch, idxs, tag_of)
        return Batch(fields, seq_idx=idxs, tag_of=tag_of)

    def __call__(self, item: tuple[int, PlannedBatch]) -> Batch:
        return self.load_planned(item[1])

    def _collate_seqs(self, batch: PlannedBatch, idxs: list[int], tag_of: Callable[[int], str]) -> dict[str, Field]:
        tags, sight, idx = SeqTags(idxs, tag_of), self._sight, batch.idx
        if self._seed_lengths:
            sight.note_lengths(self.dataset.seq_lengths())
            self._seed_lengths = False
        known = not batch.spans and sight.known(idx)
        seqs = self._load_seqs(idxs, known)
        if batch.spans:
            return collate(_cut(seqs, batch.spans), tags, self.extern_data)
        if known:
            return collate(seqs, tags, self.extern_data, validated=True, lengths=sight.lengths_of(idx))
        fields = collate(seqs, tags, self.extern_data, lengths=sight.lengths_of(idx))
        sight.record(idx, fields)
        return fields

    def _load_seqs(self, idxs: list[int], known: bool) -> list[Mapping[str, Any]]:
        """The sequences, each through the dataset's own checks; a torch dataset's tensors stay tensors
        (collate joins them with one ``torch.cat`` per key, not one conversion per item). ``known``:
        all were seen before, so their keys were found to be str then."""
        ds = self.dataset
        if not isinstance(ds, TorchDataset) or type(ds).get_seq is not TorchDataset.get_seq:
            return list(map(ds.get_seq, idxs))
        if self._items is None or not idxs or min(idxs) < 0 or max(idxs) >= len(ds):
            return list(map(ds.get_item, idxs))  # (an index out of range raises there, naming the dataset)
        raw = list(map(self._items, idxs))
        if plain_dicts(raw) if known else all_plain(raw):  # what the dataset's check would return
            return raw
        return [ds.check_item(item, i) for item, i in zip(raw, idxs)]

    def load_block(
        self, entries: EpochEntries, ranges: Sequence[tuple[int, int]], start: int, max_batches: int, max_bytes: int
    ) -> list[Batch] | None:
        """Batches ``start, start + 1, ...`` of a packed dataset gathered in one go (see
        :func:`kit.data.block.gather_block`), masks prepared; None when that does not apply."""
        tag_of = self.dataset.get_seq_tag
        first, _ = ranges[start]
        packed = self._packed_gather(entries.seq_idx[first : first + 1], tag_of)
        if packed is None:
            return None
        blocks = gather_block(packed, entries, ranges, start, max_batches, max_bytes, self._block_memory)
        if blocks is None:
            return None
        out = []
        for fields, (s, e) in zip(blocks, ranges[start:]):
            out.append(Batch(fields, seq_idx=entries.seq_idx[s:e].tolist(), tag_of=tag_of))
        return out

    def is_packed(self) -> bool:
        """Whether batches are gathered from the dataset's packed storage (known after the first batch)."""
        return isinstance(self._packed, PackedGather)

    def _packed_gather(self, idx: np.ndarray, tag_of: Callable[[int], str]) -> PackedGather | None:
        """The dataset's packed storage when it offers one that fits extern_data (asked once)."""
        if self._packed is False:
            packed_fn = getattr(self.dataset, "packed", None)
            packed = packed_fn() if callable(packed_fn) else None
            ed = self.extern_data
            if packed is not None and ed is not None and any(
                k in packed and packed[k].has_time != spec.has_time for k, spec in ed.items()
            ):
                packed = None  # a static key stored with a time axis: the per-sequence checks explain it
            self._packed = None if packed is None else PackedGather(packed, ed, int(idx[0]), tag_of)
        return self._packed if isinstance(self._packed, PackedGather) else None


def _cut(
    seqs: list[Mapping[str, Any]], spans: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> list[dict[str, Any]]:
    """The chunks: each chunked key of each row cut to its span (other keys whole, as in RETURNN)."""
    out = [dict(seq) for seq in seqs]
    for key, (rows, starts, ends) in spans.items():
        for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist()):
            out[row][key] = out[row][key][start:end]
    return out


# ---- sequences as arrays ----------------------------------------------------------------


class _Plan(NamedTuple):
    key: str
    flat: np.ndarray | None  # time keys: all frames concatenated; others: stacked (None: ``rows`` instead)
    spec: DataSpec | None
    shape: tuple[int, ...]
    dtype: np.dtype
    lengths: np.ndarray | None
    full: bool  # no row is padded
    rows: list[np.ndarray] | None = None  # the sequences' arrays, copied into the padded array as they are


def collate(
    seqs: Sequence[Mapping[str, Any]],
    tags: Sequence[str],
    extern_data: ExternData | None = None,
    *,
    validated: bool = False,
    lengths: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Field]:
    """Per key: the sequences concatenated, checked as a whole, padded into one ``[B, T_max, ...]`` array.

    ``validated``: the declared keys' sequences already passed these checks one by one (an
    earlier batch, :mod:`kit.data.first_sight`): their joined array's layout and dtype kind and
    the sparse label range are still checked, once per key. ``lengths``: the sequences' time
    lengths per key, when known (used when they add up to the joined frames).
    In a DataLoader worker all arrays of the batch live in one shared-memory block, so
    handing the batch to the main process costs one segment and no extra copy.
    """
    if not seqs:
        raise DataError("cannot collate an empty batch")
    keys = list(extern_data) if extern_data is not None else []
    keys += [k for k in seqs[0] if k not in keys]
    known = lengths or {}
    plans = [_plan(key, seqs, tags, extern_data, validated, known.get(key)) for key in keys]
    strings = {p.key: StringField(p.flat) for p in plans if p.flat is not None and p.flat.dtype.kind in STRING_KINDS}
    plans = [p for p in plans if p.key not in strings]
    shapes = [(p.shape, p.dtype) for p in plans]
    shapes += [((len(seqs),), np.dtype(np.int32)) for p in plans if p.lengths is not None]
    shared = torch.utils.data.get_worker_info() is not None
    arrays, tensors = allocate(shapes, shared)
    fields, extra = {}, iter(range(len(plans), len(arrays)))
    for j, p in enumerate(plans):
        if p.rows is not None:
            _fill_rows(arrays[j], p.rows, p.lengths, zero_padding=shared)
        elif p.flat is not None:
            _fill(arrays[j], p.flat, None if p.full else p.lengths, zero_padding=shared)
        length_tensor = None
        if p.lengths is not None:
            e = next(extra)
            arrays[e][:] = p.lengths
            length_tensor = tensors[e]
        fields[p.key] = Field(tensors[j], length_tensor, p.spec.sparse_dim if p.spec is not None else None)
    if strings:
        fields = {key: strings.get(key) or fields[key] for key in keys}  # the keys' order
    return fields


def _plan(
    key: str,
    seqs: Sequence[Mapping[str, Any]],
    tags: Sequence[str],
    extern_data: ExternData | None,
    validated: bool,
    known_lengths: np.ndarray | None,
) -> _Plan:
    spec = extern_data.specs.get(key) if extern_data is not None else None
    try:
        arrays = [seq[key] for seq in seqs]
    except KeyError:
        j = next(j for j, seq in enumerate(seqs) if key not in seq)
        if spec is not None and extern_data is not None:
            raise extern_data.missing_key(key, seqs[j], tags[j]) from None
        raise DataError(
            f"data key {key!r} is missing in sequence {tags[j]!r}, but the batch's sequence {tags[0]!r} has it"
        ) from None
    has_time = spec.has_time if spec is not None else np.ndim(arrays[0]) >= 1
    if spec is not None and has_time and spec.sparse_dim is None and _fit_as_they_are(spec, arrays):
        # dense frames whose arrays all fit the declaration (the check of a first sight, too, as attribute
        # comparisons): each sequence's array straight into its padded row, with no joined copy in between
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
        time = int(lengths.max())
        full = int(lengths.min()) == time
        return _Plan(key, None, spec, (len(arrays), time, *arrays[0].shape[1:]), spec.dtype, lengths, full, arrays)
    flat = _join(arrays, has_time)
    if spec is None:
        if flat is None:  # mixed layouts, or tensors mixed with arrays: once more as numpy, else explain
            arrays = [np.asarray(as_numpy(a)) for a in arrays]
            flat = _join(arrays, has_time)
            if flat is None:
                _explain_mixed_shapes(key, arrays, tags)
    else:
        if flat is None or not _fits(spec, flat, None if validated else arrays):
            arrays = [check_array(spec, np.asarray(as_numpy(a)), tag, check_sparse=False) for a, tag in zip(arrays, tags)]
            flat = _join(arrays, has_time)
        if spec.sparse_dim is not None and flat is not None and not labels_in_range(flat, spec.sparse_dim):
            for a, tag in zip(arrays, tags):
                check_array(spec, np.asarray(as_numpy(a)), tag)  # raises, naming the sequence
    assert flat is not None
    dtype = spec.dtype if spec is not None else flat.dtype
    if not has_time:
        return _Plan(key, flat, spec, (len(arrays), *flat.shape[1:]), dtype, None, True)
    lengths, time, full = _time_layout(arrays, flat, known_lengths)
    return _Plan(key, flat, spec, (len(arrays), time, *flat.shape[1:]), dtype, lengths, full)


def _time_layout(arrays: list[Any], flat: np.ndarray, known: np.ndarray | None) -> tuple[np.ndarray, int, bool]:
    """(lengths, longest, whether no row is padded): the ``known`` lengths when they add up to the frames."""
    total = int(known.sum()) if known is not None and len(known) == len(arrays) else -1
    if known is None or total != flat.shape[0]:
        known = np.fromiter((a.shape[0] for a in arrays), dtype=np.int32, count=len(arrays))  # tensors too
        total = flat.shape[0]
    time = int(known.max())
    return known, time, total == time * len(arrays)


def _join(arrays: list[Any], has_time: bool) -> np.ndarray | None:
    """All frames in one array (time keys) or the arrays stacked; None when their layouts differ.

    CPU tensors are joined by torch and converted once; any other mix goes through numpy.
    """
    try:
        if type(arrays[0]) is torch.Tensor:
            return (torch.cat(arrays) if has_time else torch.stack(arrays)).numpy()
        return np.concatenate(arrays) if has_time else np.stack(arrays)
    except (ValueError, RuntimeError, TypeError):
        return None


def _fits(spec: DataSpec, flat: np.ndarray, arrays: list[Any] | None) -> bool:
    """Whether every array has the declared layout and one accepted dtype (checked on the joined array;
    ``arrays`` None: their dtypes are known to agree)."""
    static = spec.shape[1:] if spec.has_time else spec.shape
    if flat.ndim != len(static) + 1 or flat.shape[1:] != static:
        return False
    return (arrays is None or len({a.dtype for a in arrays}) == 1) and kind_ok(spec, flat.dtype)


def _fit_as_they_are(spec: DataSpec, arrays: list[Any]) -> bool:
    """Whether the arrays are numpy arrays of one number dtype accepted for ``spec`` with its layout (checked one by
    one: attribute comparisons, no pass over the data)."""
    first = arrays[0]
    if type(first) is not np.ndarray or first.dtype.kind not in "biuf" or not kind_ok(spec, first.dtype):
        return False
    static = spec.shape[1:]
    return first.ndim == len(static) + 1 and first.shape[1:] == static and all(
        type(a) is np.ndarray and a.dtype == first.dtype and a.shape[1:] == static for a in arrays
    )


def _explain_mixed_shapes(key: str, arrays: list[np.ndarray], tags: Sequence[str]) -> None:
    first = arrays[0]
    has_time = first.ndim >= 1
    rest = first.shape[1:] if has_time else first.shape
    for a, tag in zip(arrays, tags):
        if a.ndim != first.ndim or (a.shape[1:] if has_time else a.shape) != rest:
            raise DataError(
                f"data key {key!r}: sequence {tag!r} has shape {a.shape}, but sequence {tags[0]!r} has "
                f"{first.shape}; only the time axis (the first) may differ"
            )
    raise DataError(f"data key {key!r}: the sequences' arrays cannot be joined")  # not reached


def _fill_rows(out: np.ndarray, rows: list[np.ndarray], lengths: np.ndarray | None, zero_padding: bool) -> None:
    """Each sequence's array into its row of ``out``, the padding after it zeroed when ``zero_padding`` (in shared
    memory; ``out`` is zeroed already otherwise: calloc'd pages cost nothing to zero, which measured faster than
    zeroing the padding alone)."""
    assert lengths is not None
    for b, (a, n) in enumerate(zip(rows, lengths.tolist())):
        out[b, :n] = a
        if zero_padding and n < out.shape[1]:
            out[b, n:] = 0


def _fill(out: np.ndarray, flat: np.ndarray, lengths: np.ndarray | None, zero_padding: bool) -> None:
    """``flat``'s frames into ``out``, padded after each row's ``lengths`` (None: no row is padded)."""
    if lengths is None or not len(lengths):
        out[...] = flat.reshape(out.shape)  # no padding: one copy (and the cast to the declared dtype)
        return
    packing.fill_padded(out, flat, packing.starts_of(lengths), lengths.astype(np.int64), zero_padding=zero_padding,
                        full=False)
