"""RETURNN's ``torch_batching``: a user's batcher groups the epoch's streamed sequences into batches.

RETURNN hands its batcher an iterable dataset of per-sequence dicts (after the length filter and
chunking) and trains on the lists of dicts it yields. kit streams the same dicts in the same order
(:class:`SequenceStream`: each data key as a numpy array, ``seq_tag``, ``seq_idx``, ``epoch``,
``num_seqs``, ``complete_frac``), runs the batcher over the whole epoch when the epoch is planned,
on the caller's (training) thread, and keeps which entries each batch holds. The plan is then a
plain kit plan: batches load, validate and pad as without the key, in worker processes or on the
prefetch thread, and ``num_batches``, resume and DDP sharding work as for kit's own batching.

Cost: every sequence of the epoch is read once more while planning (and again when a resumed epoch
is planned); nothing of it is kept. A batcher must yield the dicts it got, or new dicts holding the
same arrays (RETURNN's ``BucketOrderingIterDataPipe`` does that); one that makes new data is refused,
since kit loads each batch from the dataset again.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch.utils.data

from kit.data.batching import EpochEntries
from kit.errors import ConfigError, DataError

Batcher = Callable[[torch.utils.data.IterableDataset], Any]


class _Seq(dict):  # type: ignore[type-arg]
    """A streamed sequence dict that knows its entry (a plain dict cannot carry it)."""

    entry: int


def make_batcher(spec: Any, *, train: bool) -> Batcher:
    """The batcher ``torch_batching`` names, called as RETURNN calls it: a callable gets
    ``(dataset, train=..., **fwd_compat)``, a ``{"class": name, ...}`` dict names a class of
    ``returnn.torch.data.pipeline`` (RETURNN must be installed) built with the dict's other entries."""
    if isinstance(spec, Mapping):
        args = dict(spec)
        name = args.pop("class", None)
        if not isinstance(name, str):
            raise ConfigError(f"config key 'torch_batching': a dict needs 'class' naming a class, got {spec!r}")
        try:
            from returnn.torch.data import pipeline
        except ImportError as exc:
            raise ConfigError(
                f"config key 'torch_batching': {{'class': {name!r}}} names a class of RETURNN's "
                "returnn.torch.data.pipeline; install RETURNN (pip install returnn) or give a callable"
            ) from exc
        cls = getattr(pipeline, name, None)
        if not isinstance(cls, type):
            raise ConfigError(f"config key 'torch_batching': returnn.torch.data.pipeline has no class {name!r}")
        return lambda dataset: cls(dataset, **args)
    if callable(spec):
        fwd_compat = {f"__fwd_compat_random_arg_{os.getpid() % 100:03}": None}  # RETURNN's: the batcher takes **kwargs
        return lambda dataset: spec(dataset, train=train, **fwd_compat)
    raise ConfigError(f"config key 'torch_batching': got {spec!r}, expected a callable or a dict with 'class'")


class SequenceStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The epoch's entries as RETURNN's per-sequence dicts, in order (what RETURNN's batcher reads)."""

    def __init__(self, dataset: Any, entries: EpochEntries, order: np.ndarray, epoch: int):
        self.dataset, self.entries, self.epoch = dataset, entries, epoch
        self.num_seqs = len(order)
        where = np.empty(int(order.max()) + 1 if len(order) else 0, dtype=np.int64)
        where[order] = np.arange(len(order))
        self.positions = where[entries.seq_idx]  # RETURNN's seq_idx: the position in the epoch's order
        self.by_array: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        from kit.data.dataset import as_numpy

        spans = self.entries.spans
        epoch, num_seqs = np.array(self.epoch), np.array(self.num_seqs)
        for j, (i, pos) in enumerate(zip(self.entries.seq_idx.tolist(), self.positions.tolist())):
            seq = _Seq()
            for key, value in self.dataset.get_seq(i).items():
                arr = as_numpy(value)
                if key in spans:
                    arr = arr[int(spans[key][0][j]) : int(spans[key][1][j])]
                else:  # a view: its own object per entry (RETURNN copies the unchunked keys of a chunk)
                    arr = arr.copy() if spans else arr.view()
                seq[key] = arr
                self.by_array[id(arr)] = (weakref.ref(arr), j)
            seq["seq_tag"] = np.array(self.dataset.get_seq_tag(i))
            seq["seq_idx"] = np.array(pos)
            seq["epoch"], seq["num_seqs"] = epoch, num_seqs
            seq["complete_frac"] = np.array((pos + 1) / self.num_seqs, dtype=np.float32)
            seq.entry = j
            yield seq

    def entry_of(self, seq: Mapping[str, Any]) -> int:
        """The entry a yielded sequence dict is: the streamed dict itself, or one holding its arrays."""
        if isinstance(seq, _Seq):
            return seq.entry
        for value in seq.values() if isinstance(seq, Mapping) else ():
            ref = self.by_array.get(id(value))
            if ref is not None and ref[0]() is value:
                return ref[1]
        raise ConfigError(
            "config key 'torch_batching': the batcher yielded a sequence that kit did not stream "
            f"(keys {sorted(seq) if isinstance(seq, Mapping) else type(seq).__name__}); kit loads each batch from "
            "the dataset again, so a batcher must yield the dicts it got, or dicts holding the same arrays"
        )


def plan(batcher: Batcher, stream: SequenceStream,
         name: str) -> tuple[EpochEntries, list[tuple[int, int]], list[float], bool]:
    """Run ``batcher`` over ``stream``: the entries in batch order, the batches as ranges over them,
    and each batch's ``complete_frac`` (RETURNN's: the largest of its sequences'; 1.0 for the last), and whether the
    batcher made a torch datapipe (RETURNN's DataLoader then draws one more seed: :mod:`kit.engine.loader_draws`).

    The batcher runs on a fork of torch's generator: in RETURNN it runs in a DataLoader worker, so the numbers it
    may draw never come from the training process's generator (dropout masks stay RETURNN's)."""
    with torch.random.fork_rng(devices=[]):
        return _plan(batcher, stream, name)


def _plan(batcher: Batcher, stream: SequenceStream,
          name: str) -> tuple[EpochEntries, list[tuple[int, int]], list[float], bool]:
    batches = batcher(stream)
    if not isinstance(batches, torch.utils.data.IterableDataset):
        raise ConfigError(
            f"config key 'torch_batching': the batcher returned {type(batches).__name__}, expected a "
            "torch.utils.data.IterableDataset (as RETURNN requires)"
        )
    taken: list[int] = []
    ranges: list[tuple[int, int]] = []
    fracs: list[float] = []
    for batch in batches:
        if not isinstance(batch, (list, tuple)) or not batch:
            raise ConfigError(
                f"config key 'torch_batching': the batcher yielded {type(batch).__name__} "
                f"{'(empty)' if isinstance(batch, (list, tuple)) else ''}, expected a non-empty list of sequence dicts"
            )
        ranges.append((len(taken), len(taken) + len(batch)))
        taken += [stream.entry_of(seq) for seq in batch]
        fracs.append(max(float(seq["complete_frac"]) for seq in batch))
    stream.by_array.clear()
    if not ranges:
        raise DataError(f"dataset {name}: the torch_batching batcher yielded no batch for epoch {stream.epoch}")
    fracs[-1] = 1.0
    datapipe = isinstance(batches, torch.utils.data.IterDataPipe)
    return take(stream.entries, np.array(taken, dtype=np.int64)), ranges, fracs, datapipe


def take(entries: EpochEntries, rows: np.ndarray) -> EpochEntries:
    """The entries ``rows`` (in that order, repeats allowed)."""
    return EpochEntries(entries.seq_idx[rows], {k: (s[rows], e[rows]) for k, (s, e) in entries.spans.items()})
