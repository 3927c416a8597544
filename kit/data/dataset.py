"""The ``Dataset`` protocol (RETURNN's, reduced to random access) and the generic built-ins.

A dataset is a list of sequences. Each sequence is a dict ``key -> numpy array``,
time-major (``[T, ...]``) for keys with a time axis; 0-dim arrays (scalars) are allowed.

>>> ds = ArrayDataset([{"data": np.zeros((5, 3), "float32"), "classes": np.arange(5)}])
>>> len(ds), ds.get_seq_length(0), ds.get_seq_tag(0)
(1, {'data': 5, 'classes': 5}, 'seq-0')

The per-epoch order (``seq_ordering``, ``partition_epoch``, ``fixed_random_seed``,
``random_seed_offset``) are the dataset's own options, as in RETURNN; see :mod:`kit.data.ordering`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kit.data import ordering
from kit.data.packed import PackedKey, pack_seqs
from kit.errors import ConfigError, DataError

SeqDict = dict[str, np.ndarray]


@runtime_checkable
class DatasetProtocol(Protocol):
    """What the pipeline needs from a dataset; :class:`Dataset` implements the shared parts."""

    @property
    def num_seqs(self) -> int: ...

    def __len__(self) -> int: ...

    def get_seq(self, idx: int) -> SeqDict: ...

    def get_seq_tag(self, idx: int) -> str: ...

    def get_seq_index(self, tag: str) -> int: ...

    def get_seq_length(self, idx: int) -> dict[str, int]: ...

    def get_seq_order(self, epoch: int) -> list[int]: ...


def as_numpy(value: Any) -> np.ndarray:
    """A numpy array from an array, a torch tensor, a list or a Python scalar."""
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")  # a tensor implies torch is imported; never import it here
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return value.numpy()  # a CPU tensor without grad: a view, no copy
        except (RuntimeError, TypeError):
            return value.detach().cpu().numpy()
    return np.asarray(value)


def lengths_of(seq: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Time lengths of the keys that have a time axis (arrays with at least one dim)."""
    return {k: int(a.shape[0]) for k, a in seq.items() if np.ndim(a) >= 1}


class Dataset:
    """Base class: tags, tag lookup, lengths, per-epoch order with partitions.

    Subclasses implement ``num_seqs`` and ``get_seq``; they override ``get_seq_length``
    when lengths are known without loading the data (ordering and batch planning call it
    for every sequence once).

    Args:
        seq_ordering: RETURNN's ``seq_ordering`` ("default", "random", "laplace:.100", ...), or a
            callable ``f(epoch=...) -> str``.
        partition_epoch: split one pass over the data into this many sub-epochs.
        fixed_random_seed: RETURNN's: the seed of the random orders in every epoch.
        random_seed_offset: RETURNN's: added to the per-epoch seed (default 0).
        random_seed: kit's older name of ``random_seed_offset``.
        name: shown in error messages.
    """

    def __init__(
        self,
        *,
        seq_ordering: Any = "default",
        partition_epoch: int = 1,
        random_seed: int | None = None,
        name: str | None = None,
        fixed_random_seed: int | None = None,
        random_seed_offset: int | None = None,
    ):
        ordering.check(seq_ordering)  # fail at construction, not at the first epoch
        if not isinstance(partition_epoch, int) or isinstance(partition_epoch, bool) or partition_epoch < 1:
            raise ConfigError(
                f"{type(self).__name__}: partition_epoch must be an int >= 1, got {partition_epoch!r}"
            )
        self.seq_ordering = seq_ordering
        self.partition_epoch = partition_epoch
        self.random_seed = random_seed
        self.fixed_random_seed = fixed_random_seed
        self.random_seed_offset = random_seed_offset if random_seed_offset is not None else random_seed
        self.name = name or type(self).__name__
        self._tag_index: dict[str, int] | None = None
        self._lengths_cache: dict[str, np.ndarray] | None = None

    # ---- to implement ----------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        raise NotImplementedError

    def get_seq(self, idx: int) -> SeqDict:
        raise NotImplementedError

    # ---- shared ----------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_seqs

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, num_seqs={self.num_seqs})"

    def describe(self) -> str:
        """``'name' (Class)`` for error messages."""
        cls = type(self).__name__
        return f"'{self.name}'" + ("" if self.name == cls else f" ({cls})")

    def _check_index(self, idx: int) -> int:
        n = self.num_seqs
        if not (0 <= idx < n):
            raise IndexError(f"dataset {self.describe()}: sequence index {idx} out of range [0, {n})")
        return int(idx)

    def get_seq_tag(self, idx: int) -> str:
        return f"seq-{self._check_index(idx)}"

    def get_seq_index(self, tag: str) -> int:
        """The index of the sequence with this tag; KeyError naming the tag if there is none."""
        if self._tag_index is None:
            self._tag_index = {self.get_seq_tag(i): i for i in range(self.num_seqs)}
        try:
            return self._tag_index[tag]
        except KeyError:
            raise KeyError(f"dataset {self.describe()} has no sequence with tag {tag!r}") from None

    def get_seq_length(self, idx: int) -> dict[str, int]:
        """``key -> time length`` for the keys with a time axis (default: loads the sequence)."""
        return lengths_of(self.get_seq(idx))

    def packed(self) -> dict[str, PackedKey] | None:
        """Opt-in fast path: every key as one array plus per-sequence starts and lengths (see
        :mod:`kit.data.packed`), or None (the default) to be loaded through ``get_seq`` per sequence.

        A dataset returning it promises that ``get_seq(i)[key]`` equals ``packed()[key].seq(i)``
        for every key and sequence; batches are then gathered and padded in a few numpy operations.
        """
        return None

    def seq_lengths(self) -> dict[str, np.ndarray]:
        """All lengths at once, ``key -> int64 [num_seqs]`` (cached; computed via get_seq_length)."""
        if self._lengths_cache is None:
            per_seq = [self.get_seq_length(i) for i in range(self.num_seqs)]
            keys = sorted({k for lens in per_seq for k in lens}, key=lambda k: (k != "data", k))
            self._lengths_cache = {
                k: np.fromiter((lens.get(k, 0) for lens in per_seq), dtype=np.int64, count=len(per_seq))
                for k in keys
            }
        return self._lengths_cache

    def sort_lengths(self) -> np.ndarray:
        """Per-sequence lengths that ``sorted`` / ``laplace`` orders sort by (RETURNN's choice per class)."""
        return ordering_lengths(self.seq_lengths())

    def init_epoch(self, epoch: int) -> bool:
        """Prepare (sub-)epoch ``epoch`` before its order is asked for.

        Datasets whose sequences change from epoch to epoch (RETURNN's generated data without
        ``fixed_random_seed``, files per sub-epoch, adapted RETURNN datasets) load them here
        and return True: their lengths and tags are then read anew, and worker processes get
        the new state. The default has fixed sequences and returns False.
        """
        return False

    def set_epoch_order(self, order: np.ndarray) -> bool:
        """The pipeline's order of the epoch it starts (dataset indices, before length filter and chunking).

        A dataset whose sequences depend on their place in the epoch (HDFDataset's
        ``shuffle_frames_of_nseqs``) keeps it and returns True: the loaders and worker processes then get
        the new state. The default ignores it and returns False.
        """
        del order
        return False

    def get_seq_order(
        self, epoch: int, *, seq_ordering: Any = None, random_seed: int | None = None
    ) -> list[int]:
        """Dataset indices of sub-epoch ``epoch`` (1-based): RETURNN's order for this dataset and epoch.

        ``seq_ordering`` overrides the dataset's own for this call. ``random_seed`` (the
        config's) is accepted for the pipeline's call but does not change the order: as in
        RETURNN, the order depends on the epoch, ``fixed_random_seed`` and ``random_seed_offset``.
        """
        del random_seed
        return self.seq_order_array(epoch, seq_ordering=seq_ordering).tolist()

    def seq_order_array(self, epoch: int, *, seq_ordering: Any = None) -> np.ndarray:
        """:meth:`get_seq_order` of this class as an int64 array (the pipeline's planning reads this
        when a subclass keeps ``get_seq_order`` as it is)."""
        return ordering.seq_order_array(
            seq_ordering or self.seq_ordering,
            num_seqs=self.num_seqs,
            epoch=epoch,
            seq_len=self.sort_lengths,
            random_seed=self.random_seed_offset or 0,
            partition_epoch=self.partition_epoch,
            fixed_random_seed=self.fixed_random_seed,
        )


def ordering_lengths(lengths: Mapping[str, np.ndarray]) -> np.ndarray:
    """The length used for sorting: the ``data`` key if present, else the longest key."""
    if "data" in lengths:
        return lengths["data"]
    if not lengths:
        raise DataError("cannot sort sequences by length: the dataset has no key with a time axis")
    return np.max(np.stack(list(lengths.values())), axis=0)


def _check_seq(seq: Any, where: str | Callable[[], str], *, convert: bool = True) -> SeqDict:
    """``seq`` as a dict with str keys and numpy values (``convert=False``: values as they are)."""
    if not (type(seq) is dict or isinstance(seq, Mapping)) or not seq:
        where = where if isinstance(where, str) else where()
        hint = ""
        if isinstance(seq, (tuple, list)) and seq:
            names = ", ".join(f'"{n}": {v}' for n, v in zip(("data", "classes", "extra"), "xyz"[:len(seq)]))
            hint = f"; a sequence is a dict data key -> array: return {{{names}}} instead of a {type(seq).__name__}"
        raise DataError(f"{where}: expected a non-empty dict key -> array, got {type(seq).__name__}{hint}")
    if not convert:
        return {k if type(k) is str else str(k): v for k, v in seq.items()}
    return {k if type(k) is str else str(k): as_numpy(v) for k, v in seq.items()}


class ArrayDataset(Dataset):
    """In-memory sequences from a list of dicts, or a dict of lists (one list per key).

    >>> ArrayDataset({"data": [np.zeros((3, 2)), np.zeros((5, 2))]}, seq_tags=["a", "b"]).get_seq_index("b")
    1
    """

    def __init__(
        self,
        seqs: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Any]],
        *,
        seq_tags: Sequence[str] | None = None,
        **opts: Any,
    ):
        super().__init__(**opts)
        if isinstance(seqs, Mapping):
            sizes = {k: len(v) for k, v in seqs.items()}
            if len(set(sizes.values())) > 1:
                raise DataError(f"ArrayDataset: the lists per key differ in length: {sizes}")
            n = next(iter(sizes.values()), 0)
            seqs = [{k: v[i] for k, v in seqs.items()} for i in range(n)]
        checked = [_check_seq(s, f"ArrayDataset sequence {i}") for i, s in enumerate(seqs)]
        self._num_seqs = len(checked)
        if seq_tags is not None:
            seq_tags = [str(t) for t in seq_tags]
            if len(seq_tags) != self._num_seqs:
                raise DataError(f"ArrayDataset: {len(seq_tags)} seq_tags for {self._num_seqs} sequences")
            if len(set(seq_tags)) != len(seq_tags):
                raise DataError("ArrayDataset: seq_tags are not unique")
        self._tags = seq_tags
        # uniform sequences (the usual case) are held as one array per key: a batch is then a few
        # numpy gathers (Dataset.packed); mixed layouts stay a list of dicts, loaded one by one
        self._packed = pack_seqs(checked)
        self._seqs = None if self._packed is not None else checked
        self._lengths = None if self._packed is not None else [lengths_of(s) for s in checked]

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    def get_seq(self, idx: int) -> SeqDict:
        idx = self._check_index(idx)
        if self._seqs is not None or self._packed is None:
            return dict(self._seqs[idx]) if self._seqs is not None else {}
        return {k: pk.seq(idx) for k, pk in self._packed.items()}

    def get_seq_tag(self, idx: int) -> str:
        if self._tags is None:
            return super().get_seq_tag(idx)
        return self._tags[self._check_index(idx)]

    def get_seq_length(self, idx: int) -> dict[str, int]:
        idx = self._check_index(idx)
        if self._lengths is not None or self._packed is None:
            return dict(self._lengths[idx]) if self._lengths is not None else {}
        return {k: int(pk.lengths[idx]) for k, pk in self._packed.items() if pk.lengths is not None}

    def seq_lengths(self) -> dict[str, np.ndarray]:
        if self._packed is None:
            return super().seq_lengths()
        lengths = {k: pk.lengths for k, pk in self._packed.items() if pk.lengths is not None}
        return {k: lengths[k] for k in sorted(lengths, key=lambda k: (k != "data", k))}

    def packed(self) -> dict[str, PackedKey] | None:
        # a subclass that changes get_seq (augmentation, say) must be loaded through it
        if self._packed is None or type(self).get_seq is not ArrayDataset.get_seq:
            return None
        return self._packed


class GeneratorDataset(Dataset):
    """Sequences made on demand by a deterministic ``fn(seed, index) -> dict`` of arrays.

    ``seed`` is the data seed (fixed, so sequence ``i`` is the same in every epoch);
    ``lengths_fn(seed, index) -> dict key -> int`` lets ordering and batch planning skip
    generating the data. For worker processes, ``fn`` must be picklable (a module-level
    function, not a lambda).
    """

    def __init__(
        self,
        fn: Callable[[int, int], Mapping[str, Any]],
        num_seqs: int,
        *,
        seed: int = 0,
        lengths_fn: Callable[[int, int], Mapping[str, int]] | None = None,
        **opts: Any,
    ):
        super().__init__(**opts)
        if not callable(fn):
            raise ConfigError(f"GeneratorDataset: fn must be callable fn(seed, index) -> dict, got {fn!r}")
        if not isinstance(num_seqs, int) or num_seqs < 0:
            raise ConfigError(f"GeneratorDataset: num_seqs must be an int >= 0, got {num_seqs!r}")
        self.fn, self._num_seqs, self.seed, self.lengths_fn = fn, num_seqs, seed, lengths_fn

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    def get_seq(self, idx: int) -> SeqDict:
        idx = self._check_index(idx)
        return _check_seq(self.fn(self.seed, idx), lambda: f"GeneratorDataset fn(seed={self.seed}, index={idx})")

    def get_seq_length(self, idx: int) -> dict[str, int]:
        if self.lengths_fn is None:
            return super().get_seq_length(idx)
        return {k: int(v) for k, v in self.lengths_fn(self.seed, self._check_index(idx)).items()}


class TorchDataset(Dataset):
    """Adapter for a map-style ``torch.utils.data.Dataset`` whose items are dicts of arrays/tensors.

    ``lengths`` (a list of dicts, one per item) makes ordering cheap; without it the
    lengths are read by loading every item once.
    """

    def __init__(self, dataset: Any, *, lengths: Sequence[Mapping[str, int]] | None = None, **opts: Any):
        opts.setdefault("name", type(dataset).__name__)
        super().__init__(**opts)
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise DataError(
                f"TorchDataset needs a map-style dataset (with __getitem__ and __len__), "
                f"got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self._given_lengths = None if lengths is None else [dict(x) for x in lengths]

    @property
    def num_seqs(self) -> int:
        return len(self.dataset)

    def get_seq(self, idx: int) -> SeqDict:
        return {k: as_numpy(v) for k, v in self.get_item(idx).items()}

    def get_item(self, idx: int) -> dict[str, Any]:
        """Item ``idx`` as the wrapped dataset gives it (tensors stay tensors), keys as str.

        The batch loader reads this: it joins a batch's tensors with one ``torch.cat`` per key
        instead of converting every item to numpy first.
        """
        idx = self._check_index(idx)
        return self.check_item(self.dataset[idx], idx)

    def check_item(self, item: Any, idx: int) -> dict[str, Any]:
        """``item``, the wrapped dataset's item ``idx``, as a dict with str keys (DataError naming it if not)."""
        return _check_seq(item, lambda: f"{self.describe()} item {idx}", convert=False)

    def get_seq_length(self, idx: int) -> dict[str, int]:
        if self._given_lengths is None:
            return super().get_seq_length(idx)
        return dict(self._given_lengths[self._check_index(idx)])

    @property
    def lengths_from_items(self) -> bool:
        """Whether ``seq_lengths()`` reads the items' own lengths (no ``lengths=`` given, nothing overridden)."""
        cls = type(self)
        return self._given_lengths is None and all(
            getattr(cls, name) is getattr(base, name)
            for name, base in (("get_seq_length", TorchDataset), ("seq_lengths", Dataset), ("get_seq", TorchDataset),
                               ("get_item", TorchDataset))
        )


def from_torch_dataset(dataset: Any, **opts: Any) -> TorchDataset:
    """Wrap a map-style torch dataset (items: dicts of arrays or tensors)."""
    return TorchDataset(dataset, **opts)
