"""A planned batch of a packed dataset (:mod:`kit.data.packed`) gathered into zero-padded Fields.

Everything that holds for the whole dataset is worked out once, when the loader first
meets it (:class:`PackedGather`): the batches' keys, each key's layout checked against
``extern_data``, whether its labels need a range check, and whether its sequences lie one
after the other with one length (then a batch is one ``np.take`` of rows). A batch then
costs per key a gather into a freshly allocated array, with no Python loop over its
sequences. In a DataLoader worker all arrays of a batch live in one shared-memory block,
so handing the batch to the main process costs one segment and no extra copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch

from kit.data import packed as packing
from kit.data.batch import Field
from kit.data.batching import PlannedBatch
from kit.data.extern_data import DataSpec, ExternData, check_array, layout_ok

Shape = tuple[int, ...]
Spans = tuple[np.ndarray, np.ndarray, np.ndarray]


class KeyPlan(NamedTuple):
    """One packed key, as every batch gathers it."""

    key: str
    pk: packing.PackedKey
    spec: DataSpec | None
    dtype: np.dtype  # of the batch's array: the declared one, else the stored one
    check_labels: bool  # some stored label is out of range: each batch checks its own
    rows: np.ndarray | None  # the data as [num_seqs, length, ...] when the sequences are back to back, one length


class PackedGather:
    """The packed keys of one dataset, checked once; :meth:`gather` builds a batch's fields."""

    def __init__(
        self,
        packed: Mapping[str, packing.PackedKey],
        extern_data: ExternData | None,
        first: int,
        tag_of: Callable[[int], str],
    ):
        """``first``: a sequence that stands for all in error messages (the first batch's first)."""
        if extern_data is not None:
            missing = next((k for k in extern_data if k not in packed), None)
            if missing is not None:  # declared, but no sequence has it
                raise extern_data.missing_key(missing, packed, tag_of(first))
        keys = list(packed) if extern_data is None else list(extern_data) + [k for k in packed if k not in extern_data]
        specs = extern_data.specs if extern_data is not None else {}
        self.tag_of = tag_of
        self.keys = [_key_plan(k, packed[k], specs.get(k), first, tag_of) for k in keys]

    def gather(self, batch: PlannedBatch, shared: bool) -> dict[str, Field]:
        """The batch's fields; ``shared``: in a worker, all arrays in one shared-memory block."""
        idx = batch.idx
        layouts: dict[int, tuple[np.ndarray | None, np.ndarray | None]] = {}  # keys of one layout share it
        plans = [_layout(kp, idx, batch.spans.get(kp.key), layouts) for kp in self.keys]
        shapes = [(shape, kp.dtype) for kp, (shape, _, _, _) in zip(self.keys, plans)]
        shapes += [((len(idx),), np.dtype(np.int32)) for _, _, lengths, _ in plans if lengths is not None]
        zero = [not full for *_, full in plans] + [False] * (len(shapes) - len(plans))
        arrays, tensors = allocate(shapes, shared, zero)
        fields, extra = {}, iter(range(len(plans), len(arrays)))
        for j, (kp, (_, starts, lengths, full)) in enumerate(zip(self.keys, plans)):
            out, length_tensor = arrays[j], None
            _fill(kp, out, idx, starts, lengths, full, zero_padding=shared)
            if lengths is not None:
                e = next(extra)
                if isinstance(lengths, int):
                    arrays[e].fill(lengths)
                else:
                    arrays[e][:] = lengths
                length_tensor = tensors[e]
            if kp.check_labels:
                _check_labels(kp, out, idx, starts, lengths, self.tag_of)
            fields[kp.key] = Field(tensors[j], length_tensor, kp.spec.sparse_dim if kp.spec is not None else None)
        return fields


def _key_plan(
    key: str, pk: packing.PackedKey, spec: DataSpec | None, first: int, tag_of: Callable[[int], str]
) -> KeyPlan:
    """Layout and dtype of a packed key, once: one array holds every sequence, so one sequence
    stands for all. Labels are checked on the whole array; when some is out of range, the
    batch holding it raises, naming its sequence."""
    check_labels = False
    if spec is not None:
        if not layout_ok(spec, pk.seq(first)):
            check_array(spec, pk.seq(first), tag_of(first), check_sparse=False)  # raises, naming it
        data = pk.data
        if spec.sparse_dim is not None and data.size:
            check_labels = bool(data.min() < 0 or data.max() >= spec.sparse_dim)
    dtype = spec.dtype if spec is not None else pk.data.dtype
    return KeyPlan(key, pk, spec, dtype, check_labels, _rows_view(pk))


def _rows_view(pk: packing.PackedKey) -> np.ndarray | None:
    length, starts = pk.fixed_length, pk.starts
    if length is None or starts is None or len(pk.data) != length * len(starts):
        return None
    if not np.array_equal(starts, np.arange(len(starts), dtype=starts.dtype) * length):
        return None
    return pk.data.reshape(len(starts), length, *pk.data.shape[1:])


def _layout(
    kp: KeyPlan,
    idx: np.ndarray,
    spans: Spans | None,
    layouts: dict[int, tuple[np.ndarray | None, np.ndarray | None]],
) -> tuple[Shape, np.ndarray | None, np.ndarray | int | None, bool]:
    """(shape, starts, lengths, full) of the key's batch array: ``lengths`` an int when all rows
    have it (``starts`` then None if the rows can be taken whole); ``full``: no row is padded."""
    pk, rest = kp.pk, kp.pk.data.shape[1:]
    if pk.lengths is None:
        return (len(idx), *rest), None, None, True
    if pk.fixed_length is not None and spans is None:  # every row this long: no lengths to gather
        rows = None if kp.rows is not None or pk.starts is None else pk.starts[idx]
        return (len(idx), pk.fixed_length, *rest), rows, pk.fixed_length, True
    shared = spans is None and id(pk.lengths) in layouts
    starts, lengths = layouts[id(pk.lengths)] if shared else packing.batch_layout(pk, idx, spans)
    if spans is None:
        layouts[id(pk.lengths)] = (starts, lengths)
    assert lengths is not None
    time = int(lengths.max()) if len(idx) else 0
    return (len(idx), time, *rest), starts, lengths, False


def _fill(
    kp: KeyPlan,
    out: np.ndarray,
    idx: np.ndarray,
    starts: np.ndarray | None,
    lengths: np.ndarray | int | None,
    full: bool,
    *,
    zero_padding: bool,
) -> None:
    if lengths is None:
        packing.fill_rows(out, kp.pk.data, idx)
    elif kp.rows is not None and isinstance(lengths, int):
        packing.fill_rows(out, kp.rows, idx)  # back to back, one length: whole rows
    elif isinstance(lengths, int):
        assert starts is not None
        packing.fill_full(out, kp.pk.data, starts)
    else:
        assert starts is not None
        packing.fill_padded(out, kp.pk.data, starts, lengths, zero_padding=zero_padding, full=full)


def _check_labels(
    kp: KeyPlan,
    out: np.ndarray,
    idx: np.ndarray,
    starts: np.ndarray | None,
    lengths: np.ndarray | int | None,
    tag_of: Callable[[int], str],
) -> None:
    spec = kp.spec
    assert spec is not None and spec.sparse_dim is not None
    if not out.size or (out.min() >= 0 and out.max() < spec.sparse_dim):  # padding (0) is in range
        return
    data = kp.pk.data
    for b, i in enumerate(idx.tolist()):
        if lengths is None:
            a = data[i]
        elif starts is None:
            a = kp.pk.seq(i)
        else:
            start = int(starts[b])
            a = data[start : start + (lengths if isinstance(lengths, int) else int(lengths[b]))]
        check_array(spec, a, tag_of(i))  # raises, naming the sequence


def allocate(
    shapes: list[tuple[Shape, np.dtype]], shared: bool, zero: list[bool] | None = None
) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Arrays for one batch and the tensors over them.

    In the main process each is its own allocation: zeroed (calloc'd pages, the padding costs
    nothing) unless ``zero[j]`` is False (array ``j`` is overwritten whole). In a worker
    (``shared``) all live in one shared-memory block that the caller zero-pads itself.
    """
    if not shared:
        if zero is None:
            arrays = [np.zeros(shape, dtype) for shape, dtype in shapes]
        else:
            arrays = [(np.zeros if z else np.empty)(shape, dtype) for (shape, dtype), z in zip(shapes, zero)]
        return arrays, [torch.from_numpy(a) for a in arrays]
    sizes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in shapes]
    offsets = np.cumsum([0] + [-(-n // 16) * 16 for n in sizes])  # 16-byte aligned views
    block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(int(offsets[-1]), 1)))
    tensors = [
        block[int(off) : int(off) + n].view(torch.from_numpy(np.empty(0, dtype)).dtype).view(shape)
        for (shape, dtype), off, n in zip(shapes, offsets, sizes)
    ]
    return [t.numpy() for t in tensors], tensors
