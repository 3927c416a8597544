"""Load plan entries and collate them into a zero-padded :class:`kit.Batch`.

``BatchLoader`` is what travels to worker processes: the dataset, the parsed
``extern_data`` and which keys have a time axis. It must be picklable.

Per batch, each key costs a few numpy operations, not a Python loop over its sequences:
a dataset with packed storage (``Dataset.packed()``, see :mod:`kit.data.packed`) is
gathered straight into the padded arrays and checked against ``extern_data`` once;
any other dataset's sequences (``get_seq``) are concatenated per key, checked as a
whole, and padded. Only when a batch check fails are its sequences checked one by one,
so that the error names the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from kit.data import packed as packing
from kit.data.batch import Batch, Field
from kit.data.batching import Entry, has_spans
from kit.data.dataset import TorchDataset, as_numpy
from kit.data.extern_data import DataSpec, ExternData, check_array, kind_ok, layout_ok
from kit.errors import DataError


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
    arrays.
    """

    def __init__(self, dataset: Any, extern_data: ExternData | None, *, chunked: bool | None = None):
        self.dataset = dataset
        self.extern_data = extern_data
        self.chunked = chunked  # False: no entry has spans (the pipeline knows); None: look at each batch
        self._packed: dict[str, packing.PackedKey] | None | bool = False  # False: not asked yet
        self._keys: list[str] | None = None  # the packed batches' keys
        self._checked: dict[str, bool] = {}  # packed key -> whether batches need a label range check

    def load(self, entries: Sequence[Entry], idx: np.ndarray | None = None) -> Batch:
        """The batch of these plan entries; ``idx``: their sequence indices as int64, when at hand."""
        idxs = idx.tolist() if idx is not None else list(map(itemgetter(0), entries))
        tag_of = self.dataset.get_seq_tag
        packed = self._packed_keys()
        if packed is not None:
            if idx is None:
                idx = np.array(idxs, dtype=np.int64)
            fields = self._collate_packed(packed, entries, idx, tag_of)
        else:
            fields = collate(self._load_seqs(entries, idxs), SeqTags(idxs, tag_of), self.extern_data)
        return Batch(fields, seq_idx=idxs, tag_of=tag_of)

    def __call__(self, item: tuple[int, Sequence[Entry]]) -> Batch:
        return self.load(item[1])

    def _load_seqs(self, entries: Sequence[Entry], idxs: list[int]) -> list[Mapping[str, Any]]:
        ds = self.dataset
        # a torch dataset's tensors stay tensors until collate joins them: one conversion per key, not per item
        raw = isinstance(ds, TorchDataset) and type(ds).get_seq is TorchDataset.get_seq
        get_seq = ds.get_item if raw else ds.get_seq
        if self.chunked is False or not has_spans(entries):
            return list(map(get_seq, idxs))
        seqs = []
        for seq_idx, spans in entries:
            seq = get_seq(seq_idx)
            if spans is not None:
                seq = dict(seq)
                for key, start, end in spans:
                    seq[key] = seq[key][start:end]
            seqs.append(seq)
        return seqs

    # ---- packed datasets ----------------------------------------------------------------

    def _packed_keys(self) -> dict[str, packing.PackedKey] | None:
        """The dataset's packed storage when it offers one that fits extern_data (asked once)."""
        if self._packed is False:
            packed_fn = getattr(self.dataset, "packed", None)
            packed = packed_fn() if callable(packed_fn) else None
            ed = self.extern_data
            if packed is not None and ed is not None and any(
                k in packed and packed[k].has_time != spec.has_time for k, spec in ed.items()
            ):
                packed = None  # a static key stored with a time axis: the per-sequence checks explain it
            self._packed = packed
        return self._packed if isinstance(self._packed, dict) else None

    def _collate_packed(
        self,
        packed: dict[str, packing.PackedKey],
        entries: Sequence[Entry],
        idx: np.ndarray,
        tag_of: Callable[[int], str],
    ) -> dict[str, Field]:
        spans = _spans_by_key(entries) if self.chunked is not False and has_spans(entries) else {}
        layouts: dict[int, tuple[Any, Any]] = {}  # id(lengths) -> the batch's (starts, lengths) of unchunked keys
        plans = [
            self._packed_plan(key, packed, idx, spans.get(key), tag_of, {} if key in spans else layouts)
            for key in self._keys or self._packed_batch_keys(packed, idx, tag_of)
        ]
        shapes = [(p.shape, p.dtype) for p in plans]
        shapes += [((len(idx),), np.dtype(np.int32)) for p in plans if p.lengths is not None]
        shared = torch.utils.data.get_worker_info() is not None
        tensors = _allocate(shapes, shared)
        fields, extra = {}, iter(tensors[len(plans) :])
        for p, tensor in zip(plans, tensors):
            out, lengths = tensor.numpy(), None
            if p.starts is None or p.lengths is None:
                packing.fill_rows(out, p.pk.data, idx)
            else:
                packing.fill_padded(out, p.pk.data, p.starts, p.lengths, zero_padding=shared, full=p.full)
                lengths = next(extra)
                lengths.numpy()[:] = p.lengths
            if p.spec is not None and self._checked[p.key]:
                _check_packed_labels(p, out, idx, tag_of)
            fields[p.key] = Field(tensor, lengths, p.spec.sparse_dim if p.spec is not None else None)
        return fields

    def _packed_batch_keys(
        self, packed: dict[str, packing.PackedKey], idx: np.ndarray, tag_of: Callable[[int], str]
    ) -> list[str]:
        """The batches' keys: the declared ones, then the dataset's other keys (found once)."""
        ed = self.extern_data
        if ed is not None:
            missing = next((k for k in ed if k not in packed), None)
            if missing is not None:  # declared, but no sequence has it
                raise ed.missing_key(missing, packed, tag_of(int(idx[0])))
        self._keys = list(packed) if ed is None else list(ed) + [k for k in packed if k not in ed]
        return self._keys

    def _packed_plan(
        self,
        key: str,
        packed: dict[str, packing.PackedKey],
        idx: np.ndarray,
        spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
        tag_of: Callable[[int], str],
        layouts: dict[int, tuple[Any, Any]],
    ) -> _PackedPlan:
        pk = packed[key]
        spec = self.extern_data.specs.get(key) if self.extern_data is not None else None
        if spec is not None and key not in self._checked:
            self._checked[key] = _check_packed(spec, pk, int(idx[0]), tag_of)
        starts, lengths = layouts.get(id(pk.lengths)) or packing.batch_layout(pk, idx, spans)
        rest = pk.data.shape[1:]
        full = None
        if lengths is None:
            shape: tuple[int, ...] = (len(idx), *rest)
        else:
            layouts.setdefault(id(pk.lengths), (starts, lengths))  # a key of the same layout reuses it
            full = True if pk.fixed_length is not None and spans is None else None
            if pk.fixed_length is not None and spans is None:
                time = pk.fixed_length
            else:
                time = int(lengths.max()) if len(idx) else 0
            shape = (len(idx), time, *rest)
        dtype = spec.dtype if spec is not None else pk.data.dtype
        return _PackedPlan(key, pk, spec, shape, dtype, starts, lengths, full)


class _PackedPlan(NamedTuple):
    key: str
    pk: packing.PackedKey
    spec: DataSpec | None
    shape: tuple[int, ...]
    dtype: np.dtype
    starts: np.ndarray | None
    lengths: np.ndarray | None
    full: bool | None  # True: no row is padded


def _spans_by_key(entries: Sequence[Entry]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Chunked keys → (rows, start, end) of the batch's chunks, relative to their sequences."""
    per_key: dict[str, tuple[list[int], list[int], list[int]]] = {}
    for row, (_, spans) in enumerate(entries):
        if spans is not None:
            for key, start, end in spans:
                rows, starts, ends = per_key.setdefault(key, ([], [], []))
                rows.append(row)
                starts.append(start)
                ends.append(end)
    return {k: (np.array(r, np.int64), np.array(s, np.int64), np.array(e, np.int64)) for k, (r, s, e) in per_key.items()}


def _check_packed(spec: DataSpec, pk: packing.PackedKey, first: int, tag_of: Callable[[int], str]) -> bool:
    """Layout and dtype of a packed key, once: one array holds every sequence, so one sequence
    stands for all. Returns whether batches still need a label range check (some label of
    the whole array is out of range: the batch holding it raises, naming its sequence)."""
    if not layout_ok(spec, pk.seq(first)):
        check_array(spec, pk.seq(first), tag_of(first), check_sparse=False)  # raises, naming it
    data = pk.data
    if spec.sparse_dim is None or not data.size:
        return False
    return bool(data.min() < 0 or data.max() >= spec.sparse_dim)


def _check_packed_labels(p: _PackedPlan, out: np.ndarray, idx: np.ndarray, tag_of: Callable[[int], str]) -> None:
    spec = p.spec
    assert spec is not None and spec.sparse_dim is not None
    if out.size and (out.min() < 0 or out.max() >= spec.sparse_dim):  # padding (0) is in range
        data = p.pk.data
        for b, i in enumerate(idx.tolist()):
            if p.starts is None or p.lengths is None:
                a = data[i]
            else:
                a = data[int(p.starts[b]) : int(p.starts[b]) + int(p.lengths[b])]
            check_array(spec, a, tag_of(i))  # raises, naming the sequence


# ---- sequences as arrays ----------------------------------------------------------------


class _Plan(NamedTuple):
    key: str
    flat: np.ndarray  # time keys: all frames concatenated; others: stacked
    spec: DataSpec | None
    shape: tuple[int, ...]
    dtype: np.dtype
    lengths: np.ndarray | None


def collate(
    seqs: Sequence[Mapping[str, np.ndarray]],
    tags: Sequence[str],
    extern_data: ExternData | None = None,
    *,
    validated: bool = False,
) -> dict[str, Field]:
    """Per key: the sequences concatenated, checked as a whole, padded into one ``[B, T_max, ...]`` array.

    ``validated``: the declared keys already passed ``ExternData.check_seq`` (layout and
    dtype), so only their sparse label range is checked here, on the whole batch.
    In a DataLoader worker all arrays of the batch live in one shared-memory block, so
    handing the batch to the main process costs one segment and no extra copy.
    """
    if not seqs:
        raise DataError("cannot collate an empty batch")
    keys = list(extern_data) if extern_data is not None else []
    keys += [k for k in seqs[0] if k not in keys]
    plans = [_plan(key, seqs, tags, extern_data, validated) for key in keys]
    shapes = [(p.shape, p.dtype) for p in plans]
    shapes += [((len(seqs),), np.dtype(np.int32)) for p in plans if p.lengths is not None]
    shared = torch.utils.data.get_worker_info() is not None
    tensors = _allocate(shapes, shared)
    fields, extra = {}, iter(tensors[len(plans) :])
    for p, tensor in zip(plans, tensors):
        _fill(tensor.numpy(), p.flat, p.lengths, zero_padding=shared)
        lengths = None
        if p.lengths is not None:
            lengths = next(extra)
            lengths.numpy()[:] = p.lengths
        fields[p.key] = Field(tensor, lengths, p.spec.sparse_dim if p.spec is not None else None)
    return fields


def _plan(
    key: str,
    seqs: Sequence[Mapping[str, Any]],
    tags: Sequence[str],
    extern_data: ExternData | None,
    validated: bool,
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
    flat = _join(arrays, has_time)
    if spec is None:
        if flat is None:  # mixed layouts, or tensors mixed with arrays: once more as numpy, else explain
            arrays = [np.asarray(as_numpy(a)) for a in arrays]
            flat = _join(arrays, has_time)
            if flat is None:
                _explain_mixed_shapes(key, arrays, tags)
    else:
        if flat is None or (not validated and not _fits(spec, flat, arrays)):
            arrays = [check_array(spec, np.asarray(as_numpy(a)), tag, check_sparse=False) for a, tag in zip(arrays, tags)]
            flat = _join(arrays, has_time)
        if spec.sparse_dim is not None and flat is not None and flat.size and (
            flat.min() < 0 or flat.max() >= spec.sparse_dim
        ):
            for a, tag in zip(arrays, tags):
                check_array(spec, np.asarray(as_numpy(a)), tag)  # raises, naming the sequence
    assert flat is not None
    dtype = spec.dtype if spec is not None else flat.dtype
    if not has_time:
        return _Plan(key, flat, spec, (len(arrays), *flat.shape[1:]), dtype, None)
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int32, count=len(arrays))  # tensors too
    return _Plan(key, flat, spec, (len(arrays), int(lengths.max()), *flat.shape[1:]), dtype, lengths)


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


def _fits(spec: DataSpec, flat: np.ndarray, arrays: list[Any]) -> bool:
    """Whether every array has the declared layout and one accepted dtype (checked on the joined array)."""
    static = spec.shape[1:] if spec.has_time else spec.shape
    if flat.ndim != len(static) + 1 or flat.shape[1:] != static:
        return False
    dtypes = {a.dtype for a in arrays}
    return len(dtypes) == 1 and kind_ok(spec, flat.dtype)


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


def _allocate(shapes: list[tuple[tuple[int, ...], np.dtype]], shared: bool) -> list[torch.Tensor]:
    if not shared:  # np.zeros: calloc'd pages, the padding costs nothing
        return [torch.from_numpy(np.zeros(shape, dtype)) for shape, dtype in shapes]
    sizes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in shapes]
    offsets = np.cumsum([0] + [-(-n // 16) * 16 for n in sizes])  # 16-byte aligned views
    block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(int(offsets[-1]), 1)))
    return [
        block[int(off) : int(off) + n].view(torch.from_numpy(np.empty(0, dtype)).dtype).view(shape)
        for (shape, dtype), off, n in zip(shapes, offsets, sizes)
    ]


def _fill(out: np.ndarray, flat: np.ndarray, lengths: np.ndarray | None, zero_padding: bool) -> None:
    if lengths is None or not len(lengths) or bool((lengths == out.shape[1]).all()):
        out[...] = flat.reshape(out.shape)  # no padding: one copy (and the cast to the declared dtype)
        return
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    packing.fill_padded(out, flat, starts, lengths.astype(np.int64), zero_padding=zero_padding, full=False)
