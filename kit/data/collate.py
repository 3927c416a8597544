"""Load plan entries and collate them into a zero-padded :class:`kit.Batch`.

``BatchLoader`` is what travels to worker processes: the dataset, the parsed
``extern_data`` and which keys have a time axis. It must be picklable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from kit.data.batch import Batch, Field
from kit.data.batching import Entry
from kit.data.extern_data import ExternData, check_array
from kit.errors import DataError


class BatchLoader:
    """Loads the sequences of one planned batch, cuts chunks, validates, pads.

    Keys declared in ``extern_data`` are validated and cast to the declared dtype;
    other keys the dataset provides are passed through as they are (time axis when the
    array has at least one dim). Without ``extern_data`` everything is inferred from the
    arrays.
    """

    def __init__(self, dataset: Any, extern_data: ExternData | None):
        self.dataset = dataset
        self.extern_data = extern_data

    def load(self, entries: Sequence[Entry]) -> Batch:
        seqs, tags, idxs = [], [], []
        get_seq, get_tag, ed = self.dataset.get_seq, self.dataset.get_seq_tag, self.extern_data
        for seq_idx, spans in entries:
            tag = get_tag(seq_idx)
            seq = get_seq(seq_idx)
            if spans is not None:
                seq = dict(seq)
                for key, start, end in spans:
                    seq[key] = seq[key][start:end]
            if ed is not None:
                seq = ed.check_seq(seq, tag, check_sparse=False)  # label range: once per batch, in collate
            seqs.append(seq)
            tags.append(tag)
            idxs.append(seq_idx)
        return Batch(collate(seqs, tags, ed, validated=ed is not None), seq_tags=tags, seq_idx=idxs)

    def __call__(self, item: tuple[int, Sequence[Entry]]) -> Batch:
        return self.load(item[1])


def collate(
    seqs: Sequence[Mapping[str, np.ndarray]],
    tags: Sequence[str],
    extern_data: ExternData | None = None,
    *,
    validated: bool = False,
) -> dict[str, Field]:
    """Per key: one preallocated ``[B, T_max, ...]`` array filled in place (zero padding), no re-copy.

    ``validated``: the declared keys already passed ``ExternData.check_seq`` (layout and
    dtype), so only their sparse label range is checked here, on the whole batch.
    In a DataLoader worker all arrays of the batch live in one shared-memory block, so
    handing the batch to the main process costs one segment and no extra copy.
    """
    if not seqs:
        raise DataError("cannot collate an empty batch")
    keys = list(extern_data) if extern_data is not None else []
    keys += [k for k in seqs[0] if k not in keys]
    layouts = []
    for key in keys:
        try:
            arrays = [seq[key] for seq in seqs]
        except KeyError:
            tag = next(t for seq, t in zip(seqs, tags) if key not in seq)
            raise DataError(
                f"data key {key!r} is missing in sequence {tag!r}, but the batch's sequence {tags[0]!r} has it"
            ) from None
        spec = extern_data.specs.get(key) if extern_data is not None else None
        if spec is None:
            arrays = [np.asarray(a) for a in arrays]
            layouts.append(_layout(key, arrays, tags, arrays[0].ndim >= 1, None, check=True))
        else:
            layouts.append(_layout(key, arrays, tags, spec.has_time, spec, check=not validated))
    shapes = [(lay.shape, lay.dtype) for lay in layouts]
    shapes += [((len(seqs),), np.dtype(np.int32)) for lay in layouts if lay.lengths is not None]
    shared = torch.utils.data.get_worker_info() is not None
    tensors = _allocate(shapes, shared)
    fields, extra = {}, iter(tensors[len(layouts) :])
    for lay, tensor in zip(layouts, tensors):
        _fill(tensor.numpy(), lay.arrays, lay.lengths, zero_tails=shared)
        lengths = None
        if lay.lengths is not None:
            lengths = next(extra)
            lengths.numpy()[:] = lay.lengths
        field = Field(tensor, lengths, lay.spec.sparse_dim if lay.spec is not None else None)
        if field.sparse_dim is not None:
            _check_labels(lay.spec, field, lay.arrays, tags)
        fields[lay.key] = field
    return fields


class _Layout(NamedTuple):
    key: str
    arrays: list[np.ndarray]
    spec: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    lengths: np.ndarray | None


def _layout(
    key: str, arrays: list[np.ndarray], tags: Sequence[str], has_time: bool, spec: Any, check: bool
) -> _Layout:
    first = arrays[0]
    dtype = first.dtype
    if check:
        rest = first.shape[1:] if has_time else first.shape
        for a, tag in zip(arrays, tags):
            if a.ndim != first.ndim or (a.shape[1:] if has_time else a.shape) != rest:
                raise DataError(
                    f"data key {key!r}: sequence {tag!r} has shape {a.shape}, but sequence {tags[0]!r} has "
                    f"{first.shape}; only the time axis (the first) may differ"
                )
        if any(a.dtype != dtype for a in arrays):
            dtype = np.result_type(*arrays)
    if not has_time:
        return _Layout(key, arrays, spec, (len(arrays), *first.shape), dtype, None)
    lengths = np.fromiter(map(len, arrays), dtype=np.int32, count=len(arrays))
    return _Layout(key, arrays, spec, (len(arrays), int(lengths.max()), *first.shape[1:]), dtype, lengths)


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


def _fill(out: np.ndarray, arrays: list[np.ndarray], lengths: np.ndarray | None, zero_tails: bool) -> None:
    if lengths is None:
        for b, a in enumerate(arrays):
            out[b] = a
        return
    if not zero_tails:
        for b, a in enumerate(arrays):
            out[b, : len(a)] = a
        return
    for b, a in enumerate(arrays):
        n = len(a)
        out[b, :n] = a
        out[b, n:] = 0  # a shared block is not zeroed for us


def _check_labels(spec: Any, field: Field, arrays: list[np.ndarray], tags: Sequence[str]) -> None:
    t = field.tensor
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= spec.sparse_dim):  # padding (0) is in range
        for a, tag in zip(arrays, tags):
            check_array(spec, a, tag)  # raises, naming the sequence
