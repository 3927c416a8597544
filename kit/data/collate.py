"""Load plan entries and collate them into a zero-padded :class:`kit.Batch`.

``BatchLoader`` is what travels to worker processes: the dataset, the parsed
``extern_data`` and which keys have a time axis. It must be picklable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kit.data.batch import Batch, Field
from kit.data.batching import Entry
from kit.data.extern_data import ExternData
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
        for seq_idx, spans in entries:
            tag = self.dataset.get_seq_tag(seq_idx)
            seq = self.dataset.get_seq(seq_idx)
            if spans is not None:
                seq = dict(seq)
                for key, start, end in spans:
                    seq[key] = seq[key][start:end]
            if self.extern_data is not None:
                seq = self.extern_data.check_seq(seq, tag)
            seqs.append(seq)
            tags.append(tag)
            idxs.append(seq_idx)
        return Batch(collate(seqs, tags, self.extern_data), seq_tags=tags, seq_idx=idxs)

    def __call__(self, item: tuple[int, Sequence[Entry]]) -> Batch:
        return self.load(item[1])


def collate(
    seqs: Sequence[Mapping[str, np.ndarray]], tags: Sequence[str], extern_data: ExternData | None = None
) -> dict[str, Field]:
    """Per key: one preallocated zero array ``[B, T_max, ...]`` filled in place, one ``torch.from_numpy``."""
    if not seqs:
        raise DataError("cannot collate an empty batch")
    keys = list(extern_data) if extern_data is not None else []
    keys += [k for k in seqs[0] if k not in keys]
    fields = {}
    for key in keys:
        arrays = []
        for seq, tag in zip(seqs, tags):
            if key not in seq:
                raise DataError(
                    f"data key {key!r} is missing in sequence {tag!r} (keys {sorted(seq)}), "
                    f"but the batch's sequence {tags[0]!r} has it"
                )
            arrays.append(np.asarray(seq[key]))
        spec = extern_data.specs.get(key) if extern_data is not None else None
        has_time = spec.has_time if spec is not None else arrays[0].ndim >= 1
        fields[key] = _pad(key, arrays, tags, has_time, spec.sparse_dim if spec is not None else None)
    return fields


def _pad(
    key: str, arrays: list[np.ndarray], tags: Sequence[str], has_time: bool, sparse_dim: int | None
) -> Field:
    first = arrays[0]
    rest = first.shape[1:] if has_time else first.shape
    for a, tag in zip(arrays, tags):
        if a.ndim != first.ndim or (a.shape[1:] if has_time else a.shape) != rest:
            raise DataError(
                f"data key {key!r}: sequence {tag!r} has shape {a.shape}, but sequence {tags[0]!r} has "
                f"{first.shape}; only the time axis (the first) may differ"
            )
    dtype = first.dtype if all(a.dtype == first.dtype for a in arrays) else np.result_type(*arrays)
    if not has_time:
        return Field(torch.from_numpy(np.stack(arrays).astype(dtype, copy=False)), None, sparse_dim)
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int32, count=len(arrays))
    out = np.zeros((len(arrays), int(lengths.max()), *rest), dtype=dtype)
    for b, a in enumerate(arrays):
        out[b, : a.shape[0]] = a
    return Field(torch.from_numpy(out), torch.from_numpy(lengths), sparse_dim)
