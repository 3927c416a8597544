"""Any RETURNN dataset (object or dict) as a kit dataset, through RETURNN's own Dataset API.

For the classes kit has no native one for (``OggZipDataset``, ``LmDataset``,
``SprintDataset``, ...), with RETURNN installed. Each (sub-)epoch calls RETURNN's
``init_seq_order(epoch=...)``: RETURNN orders, partitions and generates as it always does, and
kit's indices are RETURNN's sorted sequence indices of that epoch (so kit's order is the
identity). Sequences are read with ``load_seqs`` / ``get_data`` / ``get_tag`` in ascending
order; when kit goes back (its batches after its pass over the lengths), the epoch is
initialised again, which RETURNN's sequential datasets need.

>>> ds = make_dataset({"class": "OggZipDataset", "path": "train.zip", "audio": {...}, "targets": {...}})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kit.data.dataset import Dataset, SeqDict
from kit.errors import ConfigError, DataError

EVAL_DEFAULTS = {"seq_ordering": "sorted", "shuffle_frames_of_nseqs": 0}
"""What RETURNN gives a dev / eval dataset dict that does not set them (its ``get_default_kwargs_eval``;
chunking is kit's own, per key, so its ``chunking="0"`` has no place here)."""


def returnn_installed() -> bool:
    """Whether ``returnn.datasets`` can be imported (checked without importing RETURNN itself)."""
    import importlib.util

    try:
        return importlib.util.find_spec("returnn.datasets") is not None
    except (ImportError, ValueError):
        return False


def is_returnn_dataset(obj: Any) -> bool:
    """A RETURNN ``Dataset`` object (judged without importing RETURNN when it is not loaded yet)."""
    module = type(obj).__module__ or ""
    return module.split(".")[0] == "returnn" and hasattr(obj, "init_seq_order") and hasattr(obj, "get_data")


def returnn_dataset_class(name: str) -> type | None:
    """RETURNN's dataset class of this name, or None (also when RETURNN is not installed)."""
    if not returnn_installed():
        return None
    from returnn.datasets.basic import get_dataset_class  # type: ignore[import-untyped]

    return get_dataset_class(name)


class ReturnnDataset(Dataset):
    """A RETURNN dataset behind kit's Dataset protocol (see the module docstring).

    Args:
        dataset: a RETURNN ``Dataset`` or a RETURNN dataset dict (``{"class": ..., ...}``).
        name: shown in kit's error messages (default: RETURNN's name).
        default_kwargs: options a dataset dict does not set (RETURNN's ``init_dataset(default_kwargs=)``),
            e.g. :data:`EVAL_DEFAULTS` for a dev or eval dataset, as RETURNN gives them.
    """

    def __init__(self, dataset: Any, *, name: str | None = None, default_kwargs: Mapping[str, Any] | None = None):
        if isinstance(dataset, Mapping):
            from returnn.datasets import init_dataset  # type: ignore[import-untyped]

            try:
                dataset = init_dataset(dict(dataset), default_kwargs=dict(default_kwargs or {}))
            except Exception as exc:  # RETURNN raises many types for bad options
                shuffles = {**dict(default_kwargs or {}), **dataset}.get("shuffle_frames_of_nseqs")
                hint = (" (shuffle_frames_of_nseqs > 0: RETURNN shuffles frames only in its HDFDataset; its other "
                        "classes refuse it)") if shuffles else ""
                raise ConfigError(
                    f"RETURNN dataset {dataset.get('class')!r}: {type(exc).__name__}: {exc}{hint}"
                ) from exc
        if not is_returnn_dataset(dataset):
            raise DataError(f"ReturnnDataset needs a RETURNN Dataset or dataset dict, got {type(dataset).__name__}")
        super().__init__(name=name or str(getattr(dataset, "name", type(dataset).__name__)))
        self.returnn = dataset
        self.epoch = 0
        self._ready_epoch = 0  # the epoch RETURNN's dataset is initialised for in this process
        self._loaded_up_to = 0  # sequences below this may be gone (RETURNN's sequential datasets)
        self._num = 0
        self._lengths: list[dict[str, int] | None] = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ready_epoch"] = 0  # a worker's copy initialises RETURNN's dataset itself
        return state

    # ---- epochs ----------------------------------------------------------------------

    def init_epoch(self, epoch: int) -> bool:
        if epoch == self.epoch:
            return False
        self.epoch = epoch
        self._ready()
        self._num = self._count()
        self._lengths = [None] * self._num
        self._tag_index = self._lengths_cache = None
        return True

    def _ready(self, restart: bool = False) -> None:
        if self.epoch == 0:
            self.init_epoch(1)
        if restart or self._ready_epoch != self.epoch:
            self.returnn.init_seq_order(epoch=self.epoch)
            self._ready_epoch, self._loaded_up_to = self.epoch, 0

    def _count(self) -> int:
        try:
            return int(self.returnn.num_seqs)
        except (NotImplementedError, TypeError):  # unknown in advance: count by loading (RETURNN's way)
            n = 0
            while self.returnn.is_less_than_num_seqs(n):
                n += 1
            self._ready(restart=True)
            return n

    def _load(self, idx: int) -> None:
        idx = self._check_index(idx)
        self._ready()
        if idx < self._loaded_up_to:
            self._ready(restart=True)
        self.returnn.load_seqs(idx, idx + 1)
        self._loaded_up_to = idx

    # ---- the Dataset protocol --------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        if self.epoch == 0:
            self.init_epoch(1)
        return self._num

    def get_seq(self, idx: int) -> SeqDict:
        self._load(idx)
        return {str(k): np.asarray(self.returnn.get_data(idx, k)) for k in self.returnn.get_data_keys()}

    def get_seq_tag(self, idx: int) -> str:
        self._load(idx)
        return str(self.returnn.get_tag(idx))

    def get_seq_length(self, idx: int) -> dict[str, int]:
        cached = self._lengths[self._check_index(idx)] if self._lengths else None
        if cached is None:
            self._load(idx)
            lens = self.returnn.get_seq_length(idx)
            cached = {str(k): int(lens[k]) for k in self.returnn.get_data_keys()}
            self._lengths[idx] = cached
        return dict(cached)

    def get_seq_order(self, epoch: int, *, seq_ordering: Any = None, random_seed: int | None = None) -> list[int]:
        """RETURNN has ordered the epoch already: kit keeps its order. ``seq_ordering`` is set on RETURNN's dataset."""
        if seq_ordering is not None and seq_ordering != self.returnn.seq_ordering:
            self.returnn.seq_ordering = seq_ordering
            self.epoch = 0
        self.init_epoch(epoch)
        return list(range(self._num))
