"""``DistributeFilesDataset``: many files spread over sub-epochs, one sub-dataset per sub-epoch.

RETURNN's scheme for data far larger than memory: each full epoch the file list is
shuffled (``seq_ordering="random"``) or kept (``"default"``) and cut into
``partition_epoch`` bins of about equal total file size; sub-epoch ``e`` builds the dataset
``get_sub_epoch_dataset(files of its bin)`` (e.g. an ``HDFDataset``) and trains on it in that
dataset's own order (seeded by the full epoch, as RETURNN does). Only that bin's files are
open. With ``distrib_shard_files=True`` under ``torchrun`` the files are first cut into
``world_size`` shares and each rank reads only its own; each rank then trains on all
batches of its own share, and a sub-epoch ends for all ranks when the first rank runs out
(RETURNN: "whenever one GPU finishes its sub epoch, all remaining data on the other GPUs
is dropped").

>>> def get_sub_epoch_dataset(files):
...     return {"class": "HDFDataset", "files": files, "seq_ordering": "laplace:.1000"}
>>> train = {"class": "DistributeFilesDataset", "files": [f"data/{i}.hdf" for i in range(100)],
...          "get_sub_epoch_dataset": get_sub_epoch_dataset, "partition_epoch": 20, "seq_ordering": "random"}
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kit.data import ordering
from kit.data.dataset import Dataset, SeqDict
from kit.data.meta import make_child
from kit.errors import ConfigError, DataError
from kit.fileio import read_capped

MAX_FILE_LIST_BYTES = 256 << 20  # a million paths of 256 bytes

FileTree = Any  # a file name, or tuples / lists / dicts of them (files that belong together)


def flatten_files(tree: FileTree) -> list[str]:
    """The file names in a file tree (dicts in sorted key order)."""
    if isinstance(tree, (str, os.PathLike)):
        return [os.fspath(tree)]
    if isinstance(tree, dict):
        return [f for k in sorted(tree) for f in flatten_files(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [f for t in tree for f in flatten_files(t)]
    raise ConfigError(f"DistributeFilesDataset: a file entry must be a path or a list/tuple/dict of them, got {tree!r}")


def read_file_list(files: Any) -> list[FileTree]:
    """``files`` as a list: given directly, by a callable, or in a ``.txt`` / ``.json`` / ``.py`` list file."""
    if callable(files):
        files = files()
    if isinstance(files, (list, tuple)):
        return list(files)
    if not isinstance(files, (str, os.PathLike)):
        raise ConfigError(f"DistributeFilesDataset: 'files' must be a list, a callable or a list file, got {files!r}")
    path = os.fspath(files)
    ext = os.path.splitext(path)[1]
    if ext not in (".txt", ".json", ".py"):
        raise ConfigError(f"DistributeFilesDataset: file list {path!r} must end in .txt, .json or .py")
    data = read_capped(path, MAX_FILE_LIST_BYTES, "DistributeFilesDataset: file list", ConfigError,
                       "a list of file names")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"DistributeFilesDataset: file list {path!r} is not UTF-8 text (byte {e.start})") from None
    if ext == ".txt":
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    try:
        out = json.loads(text) if ext == ".json" else ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as e:
        what = ("is not valid JSON" if ext == ".json" else
                "is not a plain Python list of strings (it holds code, names or calls, which kit never runs, "
                "or is not valid Python)")
        raise ConfigError(f"DistributeFilesDataset: file list {path!r} {what}: {type(e).__name__}: "
                          f"{str(e).split(' at 0x')[0][:200]}") from None
    if not isinstance(out, list):
        raise ConfigError(f"DistributeFilesDataset: {path!r} must hold a list of files")
    return out


def _file_size(path: str, index: int) -> int:
    """The size of one listed file, checked when the dataset is made (not at the sub-epoch that needs it)."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise ConfigError(f"DistributeFilesDataset: file {path!r} (entry {index} of 'files') does not exist; "
                          "fix the list or create the file") from None
    except OSError as e:
        raise ConfigError(f"DistributeFilesDataset: file {path!r} (entry {index} of 'files') cannot be read "
                          f"({e.strerror or e})") from None


def distribute_by_size(sizes: Sequence[int], num_bins: int) -> list[list[int]]:
    """Cut positions ``0..len(sizes)-1`` (in order) into ``num_bins`` non-empty runs of about equal size.

    RETURNN's greedy rule: fill a bin up to the remaining average; a file that would overfill
    it goes where it leaves the bin closer to that average; leave enough files for the
    remaining bins.
    """
    n = len(sizes)
    if n < num_bins:
        raise ConfigError(f"DistributeFilesDataset: {n} files cannot fill {num_bins} sub-epochs/shards")
    total = float(sum(sizes))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    b, taken, total_taken = 0, 0.0, 0.0
    avg = total / num_bins
    for i, size in enumerate(sizes):
        total_taken += size
        if n - i <= num_bins - b - 1:  # exactly enough files left: one per remaining bin
            b += 1
            avg = (total - total_taken) / (num_bins - b)
            bins[b].append(i)
            taken = size
        elif b == num_bins - 1 or taken + size <= avg:
            bins[b].append(i)
            taken += size
        else:
            if not bins[b] or abs(taken + size - avg) <= abs(taken - avg):
                bins[b].append(i)
                taken = 0
            else:
                bins[b + 1].append(i)
                taken = size
            b += 1
            avg = (total - total_taken) / (num_bins - b)
    return bins


def distributed_rank_and_size() -> tuple[int, int]:
    """This process' rank and the number of processes (torchrun's ``RANK`` / ``WORLD_SIZE``; else 0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class DistributeFilesDataset(Dataset):
    """RETURNN's ``DistributeFilesDataset`` (see the module docstring).

    Args:
        files: the files (or file trees), a callable returning them, or a list file.
        get_sub_epoch_dataset: ``f(files) -> dataset dict`` (or dataset) for one sub-epoch.
        distrib_shard_files: under torchrun, each rank reads only its own share of the files.
        seq_ordering: of the files: ``"default"`` or ``"random"`` (the sub-dataset orders its sequences).
        use_worker_proc, preload_next_n_sub_epochs, buffer_size, sharding_fix: RETURNN's
            process options; accepted, kit builds the sub-epoch's dataset in the pipeline's process
            (its batches load in the pipeline's workers, ``torch_dataloader_opts``).
    """

    def __init__(
        self,
        *,
        files: Any,
        get_sub_epoch_dataset: Callable[[list[FileTree]], Any],
        distrib_shard_files: bool = False,
        use_worker_proc: bool = True,
        preload_next_n_sub_epochs: int | None = None,
        buffer_size: int = 1,
        sharding_fix: bool | None = None,
        **opts: Any,
    ):
        super().__init__(**opts)
        del use_worker_proc, preload_next_n_sub_epochs, buffer_size, sharding_fix
        if not callable(get_sub_epoch_dataset):
            raise ConfigError("DistributeFilesDataset: get_sub_epoch_dataset must be a callable f(files) -> dataset dict")
        if callable(self.seq_ordering) or self.seq_ordering not in ("default", "random"):
            raise ConfigError(
                f"DistributeFilesDataset: seq_ordering (of the files) must be 'default' or 'random', "
                f"got {self.seq_ordering!r}; the sub-epoch dataset orders its sequences"
            )
        self.get_sub_epoch_dataset = get_sub_epoch_dataset
        self.files = read_file_list(files)
        self.distrib_shard_files = bool(distrib_shard_files)
        self.shard_index, self.num_shards = distributed_rank_and_size() if distrib_shard_files else (0, 1)
        if len(self.files) < self.partition_epoch * self.num_shards:
            raise ConfigError(
                f"DistributeFilesDataset: {len(self.files)} files < partition_epoch {self.partition_epoch}"
                + (f" x {self.num_shards} ranks" if self.num_shards > 1 else "")
            )
        self.file_sizes = [sum(_file_size(f, i) for f in flatten_files(t)) for i, t in enumerate(self.files)]
        self.sub_epoch_files: list[FileTree] | None = None
        self.sub_dataset: Dataset | None = None
        self._full_epoch = 0

    @property
    def sharded_by_rank(self) -> bool:
        """Each torchrun rank has its own files: the pipeline must not split its batches again."""
        return self.num_shards > 1

    def files_of_epoch(self, epoch: int) -> list[FileTree]:
        """The files of sub-epoch ``epoch`` on this rank (RETURNN's shuffle and bins)."""
        full_epoch = (epoch - 1) // self.partition_epoch + 1
        order = list(range(len(self.files)))
        if self.seq_ordering == "random":
            seed = ordering.random_seed_for_epoch(
                full_epoch,
                fixed_random_seed=self.fixed_random_seed,
                random_seed_offset=self.random_seed_offset or 0,
            )
            np.random.RandomState(seed).shuffle(order)
        bins = distribute_by_size([self.file_sizes[i] for i in order], self.num_shards * self.partition_epoch)
        mine = bins[self.partition_epoch * self.shard_index + (epoch - 1) % self.partition_epoch]
        return [self.files[order[i]] for i in mine]

    def init_epoch(self, epoch: int) -> bool:
        files = self.files_of_epoch(epoch)
        full_epoch = (epoch - 1) // self.partition_epoch + 1
        if self.sub_dataset is not None and files == self.sub_epoch_files:
            self._full_epoch = full_epoch
            return self.sub_dataset.init_epoch(full_epoch)
        self._close_sub_dataset()
        spec = self.get_sub_epoch_dataset(list(files))
        if isinstance(spec, dict) and spec.get("partition_epoch", 1) != 1:
            raise ConfigError("DistributeFilesDataset: the sub-epoch dataset must not set partition_epoch")
        sub = make_child(spec, self, f"{self.name}_sub{epoch}")
        sub.init_epoch(full_epoch)  # RETURNN initialises the sub-epoch's dataset with the full epoch
        self.sub_dataset, self.sub_epoch_files, self._full_epoch = sub, files, full_epoch
        self._tag_index = self._lengths_cache = None
        return True

    def _close_sub_dataset(self) -> None:
        close = getattr(self.sub_dataset, "close", None)
        if callable(close):
            close()
        self.sub_dataset = None

    def _sub(self) -> Dataset:
        if self.sub_dataset is None:
            self.init_epoch(1)
        assert self.sub_dataset is not None
        return self.sub_dataset

    @property
    def num_seqs(self) -> int:
        return len(self._sub())

    def get_seq(self, idx: int) -> SeqDict:
        return self._sub().get_seq(self._check_index(idx))

    def get_seq_tag(self, idx: int) -> str:
        return self._sub().get_seq_tag(self._check_index(idx))

    def get_seq_length(self, idx: int) -> dict[str, int]:
        return self._sub().get_seq_length(self._check_index(idx))

    def seq_lengths(self) -> dict[str, np.ndarray]:
        return self._sub().seq_lengths()

    def get_seq_order(self, epoch: int, *, seq_ordering: Any = None, random_seed: int | None = None) -> list[int]:
        """The sub-epoch dataset's own order (for the full epoch); ``seq_ordering`` overrides the sub-dataset's."""
        self.init_epoch(epoch)
        if not len(self._sub()):
            raise DataError(f"DistributeFilesDataset {self.describe()}: sub-epoch {epoch} has no sequences")
        return self._sub().get_seq_order(self._full_epoch, seq_ordering=seq_ordering)
