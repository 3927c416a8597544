"""RETURNN's dataset combinators: ``StaticDataset``, ``ConcatDataset``, ``MetaDataset``.

Their sub-datasets are given as datasets or as dicts (``{"class": "HDFDataset", ...}``), and
inherit the parent's ``random_seed_offset`` as in RETURNN. Orders follow RETURNN:
``ConcatDataset`` concatenates its sub-datasets' own orders; ``MetaDataset`` takes the
order of ``seq_order_control_dataset`` (or its own ``seq_ordering`` over the sequences of
the dataset that provides ``data``) and finds every other key's sequence by its tag.

>>> meta = MetaDataset(
...     datasets={"feat": {"class": "HDFDataset", "files": ["f.hdf"]},
...               "align": {"class": "HDFDataset", "files": ["a.hdf"]}},
...     data_map={"data": ("feat", "data"), "classes": ("align", "classes")},
...     seq_order_control_dataset="feat")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kit.data.dataset import ArrayDataset, Dataset, SeqDict
from kit.errors import ConfigError, DataError

BuildDataset = Callable[[Any], Dataset]
# make_dataset, handed over by kit.data.make when it loads (it imports this module for its class
# registry, so this module cannot import it back); kit.data's package init always loads it
_build_child: BuildDataset | None = None


def set_child_builder(build: BuildDataset) -> None:
    """How sub-datasets given as dicts are built (:func:`kit.data.make.make_dataset`)."""
    global _build_child
    _build_child = build


def make_child(spec: Any, parent: Dataset, name: str) -> Dataset:
    """A sub-dataset from a dict or dataset; a dict inherits the parent's ``random_seed_offset``."""
    if isinstance(spec, Dataset):
        return spec
    if _build_child is None:
        raise DataError("kit.data.make is not loaded: import kit.data before building a meta dataset")
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if parent.random_seed_offset is not None:
            spec.setdefault("random_seed_offset", parent.random_seed_offset)
        spec.setdefault("name", name)
    child = _build_child(spec)
    if getattr(child, "shuffle_frames_of_nseqs", 0):
        raise ConfigError(
            f"{parent.describe()}: its sub-dataset {child.describe()} sets shuffle_frames_of_nseqs, but kit shuffles "
            f"frames only in the dataset a pipeline iterates (RETURNN's MetaDataset refuses it for itself): set it "
            f"to 0 here, or train on the HDFDataset directly"
        )
    return child


class StaticDataset(ArrayDataset):
    """RETURNN's ``StaticDataset``: a list of dicts ``key -> array``; tags ``seq-<i>``.

    ``sorted`` orders sort by the first key (``data`` if present, else the first in sorted
    order), as RETURNN does. ``target_list``, ``input_dim`` and ``output_dim`` are RETURNN's
    options for the dims; kit reads the dims from the arrays and only checks the keys.
    """

    def __init__(
        self,
        data: Sequence[Mapping[str, Any]],
        *,
        target_list: Sequence[str] | None = None,
        input_dim: int | None = None,
        output_dim: Any = None,
        **opts: Any,
    ):
        del input_dim, output_dim  # RETURNN's dims; kit takes them from the arrays
        if not data:
            raise ConfigError("StaticDataset: 'data' is empty; give a list of dicts key -> array")
        super().__init__(data, **opts)
        keys = sorted(self.get_seq(0))
        self.data_keys = (["data"] if "data" in keys else []) + [k for k in keys if k != "data"]
        missing = [k for k in target_list or () if k not in self.data_keys]
        if missing:
            raise ConfigError(f"StaticDataset: target_list names {missing}, not in the data keys {self.data_keys}")

    def sort_lengths(self) -> np.ndarray:
        return self.seq_lengths()[self.data_keys[0]]


class ConcatDataset(Dataset):
    """RETURNN's ``ConcatDataset``: the sub-datasets one after the other, each in its own order."""

    def __init__(self, datasets: Sequence[Any], **opts: Any):
        super().__init__(**opts)
        if not datasets:
            raise ConfigError("ConcatDataset: 'datasets' is empty")
        self.datasets = [make_child(d, self, f"{self.name}_{i}") for i, d in enumerate(datasets)]
        self._offsets = np.cumsum([0] + [len(d) for d in self.datasets])

    @property
    def num_seqs(self) -> int:
        return int(self._offsets[-1])

    def _locate(self, idx: int) -> tuple[Dataset, int]:
        idx = self._check_index(idx)
        i = int(np.searchsorted(self._offsets, idx, side="right")) - 1
        return self.datasets[i], idx - int(self._offsets[i])

    def get_seq(self, idx: int) -> SeqDict:
        ds, j = self._locate(idx)
        return ds.get_seq(j)

    def get_seq_tag(self, idx: int) -> str:
        ds, j = self._locate(idx)
        return ds.get_seq_tag(j)

    def get_seq_length(self, idx: int) -> dict[str, int]:
        ds, j = self._locate(idx)
        return ds.get_seq_length(j)

    def seq_lengths(self) -> dict[str, np.ndarray]:
        parts = [d.seq_lengths() for d in self.datasets]
        keys = list(dict.fromkeys(k for p in parts for k in p))
        return {
            k: np.concatenate([p.get(k, np.zeros(len(d), np.int64)) for p, d in zip(parts, self.datasets)])
            for k in keys
        }

    def init_epoch(self, epoch: int) -> bool:
        changed = [d.init_epoch(epoch) for d in self.datasets]
        if any(changed):
            self._offsets = np.cumsum([0] + [len(d) for d in self.datasets])
            self._tag_index = self._lengths_cache = None
        return any(changed)

    def get_seq_order(self, epoch: int, *, seq_ordering: Any = None, random_seed: int | None = None) -> list[int]:
        """RETURNN's: each sub-dataset's order of ``epoch``, concatenated.

        A ``seq_ordering`` other than ``default`` (the dataset's own or the config's) orders
        the whole concatenation instead; RETURNN refuses that.
        """
        if (seq_ordering or self.seq_ordering) != "default":
            return super().get_seq_order(epoch, seq_ordering=seq_ordering)
        out: list[int] = []
        for ds, start in zip(self.datasets, self._offsets):
            out += [int(start) + i for i in ds.get_seq_order(epoch)]
        return out


class MetaDataset(Dataset):
    """RETURNN's ``MetaDataset``: keys from several datasets, joined by sequence tag.

    Args:
        datasets: name -> dataset or dataset dict (only those named in ``data_map`` are built).
        data_map: output key -> ``(dataset name, key in that dataset)``.
        seq_order_control_dataset: the dataset whose order (its own ``seq_ordering``,
            ``partition_epoch``, ...) is used; default: the one that provides ``data``,
            ordered by this dataset's own ``seq_ordering``.
    """

    def __init__(
        self,
        datasets: Mapping[str, Any],
        data_map: Mapping[str, Sequence[str]],
        *,
        seq_order_control_dataset: str | None = None,
        seq_list_file: Any = None,
        seq_lens_file: Any = None,
        data_dims: Any = None,
        data_dtypes: Any = None,
        window: int = 1,
        **opts: Any,
    ):
        super().__init__(**opts)
        del data_dims, data_dtypes  # deprecated in RETURNN: only checks there
        unsupported = {"seq_list_file": seq_list_file, "seq_lens_file": seq_lens_file}
        unsupported_set = [k for k, v in unsupported.items() if v is not None] + (["window"] if window != 1 else [])
        if unsupported_set:
            raise ConfigError(f"MetaDataset: {unsupported_set} are not supported by kit")
        self.data_map = {str(k): (str(v[0]), str(v[1])) for k, v in data_map.items()}
        unknown = sorted({v[0] for v in self.data_map.values()} - set(datasets))
        if unknown:
            raise ConfigError(f"MetaDataset: data_map names datasets {unknown}, not in 'datasets' {sorted(datasets)}")
        if seq_order_control_dataset is None and "data" not in self.data_map:
            raise ConfigError("MetaDataset: without seq_order_control_dataset, data_map needs a 'data' entry")
        if seq_order_control_dataset is not None and seq_order_control_dataset not in datasets:
            raise ConfigError(f"MetaDataset: seq_order_control_dataset {seq_order_control_dataset!r} is not in 'datasets'")
        self.seq_order_control_dataset = seq_order_control_dataset
        self.control = seq_order_control_dataset or self.data_map["data"][0]
        used = [self.control] + sorted({v[0] for v in self.data_map.values()} - {self.control})
        self.datasets = {k: make_child(datasets[k], self, f"{self.name}_{k}") for k in used}
        self._maps: dict[str, np.ndarray] | None = None

    # ---- joining by tag --------------------------------------------------------------

    def _tag_maps(self) -> dict[str, np.ndarray]:
        """For every sub-dataset, the index of each control sequence's tag in it."""
        if self._maps is None:
            control = self.datasets[self.control]
            all_tags = getattr(control, "all_tags", None)  # one read per file instead of one per sequence
            tags = list(all_tags()) if callable(all_tags) else [control.get_seq_tag(i) for i in range(len(control))]
            maps = {self.control: np.arange(len(tags), dtype=np.int64)}
            for name, ds in self.datasets.items():
                if name != self.control:
                    maps[name] = self._find_tags(name, ds, tags)
            self._maps = maps
        return self._maps

    def _find_tags(self, name: str, ds: Dataset, tags: list[str]) -> np.ndarray:
        out = np.empty(len(tags), dtype=np.int64)
        for i, tag in enumerate(tags):
            try:
                out[i] = ds.get_seq_index(tag)
            except KeyError:
                raise DataError(
                    f"MetaDataset {self.describe()}: sequence {tag!r} of dataset {self.control!r} "
                    f"is missing in dataset {name!r}"
                ) from None
        return out

    # ---- the Dataset protocol --------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.datasets[self.control])

    def get_seq(self, idx: int) -> SeqDict:
        idx, maps = self._check_index(idx), self._tag_maps()
        loaded: dict[str, SeqDict] = {}
        out: SeqDict = {}
        for key, (name, sub_key) in self.data_map.items():
            if name not in loaded:
                loaded[name] = self.datasets[name].get_seq(int(maps[name][idx]))
            if sub_key not in loaded[name]:
                raise DataError(f"MetaDataset {self.describe()}: dataset {name!r} has no key {sub_key!r}")
            out[key] = loaded[name][sub_key]
        return out

    def get_seq_tag(self, idx: int) -> str:
        return self.datasets[self.control].get_seq_tag(idx)

    def get_seq_index(self, tag: str) -> int:
        return self.datasets[self.control].get_seq_index(tag)

    def get_seq_length(self, idx: int) -> dict[str, int]:
        idx, maps = self._check_index(idx), self._tag_maps()
        out = {}
        for key, (name, sub_key) in self.data_map.items():
            lens = self.datasets[name].get_seq_length(int(maps[name][idx]))
            if sub_key in lens:
                out[key] = lens[sub_key]
        return out

    def seq_lengths(self) -> dict[str, np.ndarray]:
        maps = self._tag_maps()
        out = {}
        for key, (name, sub_key) in self.data_map.items():
            lens = self.datasets[name].seq_lengths()
            if sub_key in lens:
                out[key] = lens[sub_key][maps[name]]
        return out

    def sort_lengths(self) -> np.ndarray:
        """RETURNN sorts by the ``data`` length of the dataset that provides ``data``."""
        lens = self.datasets[self.control].seq_lengths()
        return lens["data"] if "data" in lens else self.datasets[self.control].sort_lengths()

    def init_epoch(self, epoch: int) -> bool:
        changed = any([d.init_epoch(epoch) for d in self.datasets.values()])
        if changed:
            self._maps = self._tag_index = self._lengths_cache = None
        return changed

    def get_seq_order(self, epoch: int, *, seq_ordering: Any = None, random_seed: int | None = None) -> list[int]:
        """The control dataset's order (RETURNN's ``seq_order_control_dataset``), else this dataset's own."""
        if self.seq_order_control_dataset is not None:
            return self.datasets[self.control].get_seq_order(epoch, seq_ordering=seq_ordering)
        return super().get_seq_order(epoch, seq_ordering=seq_ordering)
