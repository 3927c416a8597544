"""``Pipeline``: dataset → order → length filter → chunking → batching → collate, resumable.

>>> pipe = Pipeline(Task12AXDataset(100), batch_size=500, max_seqs=8)
>>> pipe.set_epoch(1)
>>> batch = next(pipe)                 # kit.Batch; pipe.position == 1
>>> pipe.state_dict()                  # {"epoch": 1, "position": 1, ...}

Each epoch's batches are planned up front from the order and the cheap sequence
lengths (:mod:`kit.data.batching`); loading, validation against ``extern_data`` and
padding happen per batch, in the main process (``num_workers=0``, no DataLoader at all)
or in worker processes that return exactly the same batches in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from kit.config import Config
from kit.config.keys import KEYS
from kit.data import batching, ordering
from kit.data.ahead import LoadAhead
from kit.data.batch import Batch
from kit.data.collate import BatchLoader
from kit.data.dataset import Dataset, ordering_lengths
from kit.data.extern_data import ExternData, make_extern_data
from kit.data.make import make_dataset
from kit.data.options import PipelineOptions
from kit.data.prefetch import Prefetch, loads_off_thread
from kit.data.workers import WorkerPool, check_picklable
from kit.errors import ConfigError, DataError


def _shuffle_buffer(spec: int | Mapping[str, int] | None) -> int | None:
    """``online_shuffle_batches`` (an int, or ``{"buffer_size": n}``, checked by the key registry) as the
    buffer size; None when off."""
    check = KEYS["online_shuffle_batches"].check
    problem = check(spec) if check is not None else None
    if problem:
        raise ConfigError(f"config key 'online_shuffle_batches': got {spec!r}, expected {problem}")
    if spec is None:
        return None
    return int(spec["buffer_size"] if isinstance(spec, Mapping) else spec)


def _describe(dataset: Any) -> str:
    return dataset.describe() if isinstance(dataset, Dataset) else repr(type(dataset).__name__)


def _all_lengths(dataset: Any) -> dict[str, np.ndarray]:
    if hasattr(dataset, "seq_lengths"):
        return dict(dataset.seq_lengths())
    per_seq = [dataset.get_seq_length(i) for i in range(len(dataset))]
    keys = sorted({k for lens in per_seq for k in lens})
    return {k: np.array([lens.get(k, 0) for lens in per_seq], dtype=np.int64) for k in keys}


class Pipeline:
    """Batches of one dataset, epoch by epoch, with a resumable position.

    Args:
        dataset: a Dataset, a ``{"class": ...}`` dict, or a map-style torch dataset.
        options: the settings (:class:`PipelineOptions`; None: the key registry's defaults).
        extern_data: the data spec; batches are validated against it (None: inferred).
        train: chunking only applies in training unless ``chunking_in_eval`` (the config key).
        seq_indices: restrict to these dataset indices (in the epoch's order; partitions
            are not applied then).
        **changes: options changed from ``options`` (``batch_size=``, ``max_seqs=``, ``seq_ordering=``,
            ``num_workers=``, ``prefetch=``, ...), validated like config keys.

    With ``prefetch`` > 0 (the default, config key ``data_prefetch``) and no worker processes, the
    next batches of kit's own datasets load on a background thread while the step runs
    (:mod:`kit.data.prefetch`); batches, order and ``position`` are those without it.
    """

    def __init__(
        self,
        dataset: Any,
        options: PipelineOptions | None = None,
        *,
        extern_data: Mapping[str, Any] | ExternData | None = None,
        train: bool = True,
        seq_indices: Sequence[int] | None = None,
        **changes: Any,
    ):
        import numpy.random  # noqa: F401 - numpy loads it on first use (0.1-0.3 s): when built, not at the first batch

        opts = options if options is not None else PipelineOptions.read(None, train=train)
        if changes:
            opts = opts.replace(**changes)
        self.options = opts
        self.dataset = make_dataset(dataset)
        self.extern_data = make_extern_data(extern_data)
        self.train = train
        problems = [
            p
            for p in (self._check_limit("batch_size", opts.batch_size), self._check_limit("max_seqs", opts.max_seqs))
            if p
        ]
        if problems:
            raise ConfigError(problems)
        self.batch_size, self.max_seqs = opts.batch_size, opts.max_seqs
        self.packed_batch_size, self.packed_batch_cost = opts.packed_batch_size, opts.packed_batch_cost
        if (self.packed_batch_size is not None and opts.torch_batching is None
                and (callable(self.batch_size) or callable(self.max_seqs))):
            raise ConfigError("'packed_batch_size' together with a callable 'batch_size' or 'max_seqs' is not "
                              "supported: give batch_size/max_seqs as numbers, or drop packed_batch_size")
        self._batcher = None
        self._batcher_datapipe = True  # RETURNN's batching is a torch datapipe (kit.engine.loader_draws)
        if opts.torch_batching is not None:  # RETURNN's: the batcher replaces batch_size, max_seqs, packed_*
            from kit.data.custom_batching import make_batcher

            self._batcher = make_batcher(opts.torch_batching, train=train)
        self.min_seq_length, self.max_seq_length = opts.min_seq_length, opts.max_seq_length
        self.chunking = opts.chunking if (train or opts.chunking_in_eval) else None
        check_chunking = KEYS["chunking"].check
        problem = check_chunking(self.chunking) if check_chunking is not None else None
        if problem:
            raise ConfigError(f"chunking: got {self.chunking!r}, expected {problem}")
        self.min_chunk_size = opts.min_chunk_size
        if opts.seq_ordering is not None:
            ordering.parse(opts.seq_ordering)
        self.seq_ordering = opts.seq_ordering
        self.random_seed = int(opts.random_seed)
        self.shuffle_buffer = _shuffle_buffer(opts.online_shuffle_batches) if train else None
        self.seq_indices = None if seq_indices is None else [int(i) for i in seq_indices]
        self.num_workers = opts.num_workers
        self._loader = BatchLoader(self.dataset, self.extern_data)
        self._pool: WorkerPool | None = None
        self._pool_opts = dict(opts.dataloader_opts)
        if self.num_workers > 0:
            check_picklable(self._loader, self.num_workers, _describe(self.dataset))
            self._pool = WorkerPool(self._loader, self.num_workers, self._pool_opts)
        self._lengths: dict[str, np.ndarray] | None = None
        self._entries = batching.EpochEntries(np.zeros(0, dtype=np.int64), {})
        self._ranges: list[tuple[int, int]] | None = None  # the batches (a sharding subclass keeps its share)
        self._fracs: list[float] = []  # RETURNN's complete_frac after each batch
        self._iter: Iterator[Batch] | None = None
        self._ahead = LoadAhead()  # without workers: the next batches of a packed dataset, loaded together
        self._prefetch: Prefetch | None = None  # the background thread, while one runs
        self.epoch = 0
        self.position = 0

    @property
    def batches_are_datapipe(self) -> bool:
        """Whether RETURNN's DataLoader would iterate a torch datapipe here (its own batching, or a batcher's
        result wrapped in its online shuffle): it then draws one more seed (:mod:`kit.engine.loader_draws`)."""
        return self._batcher_datapipe or self.shuffle_buffer is not None

    @property
    def prefetching(self) -> bool:
        """Whether batches load on a background thread (``prefetch`` > 0, no workers, kit's own dataset)."""
        return self.options.prefetch > 0 and self._pool is None and loads_off_thread(self.dataset)

    @staticmethod
    def _check_limit(name: str, value: Any) -> str | None:
        if value is None:
            return None
        check = KEYS[name].check
        problem = check(value) if check else None
        return f"{name}: got {value!r}, expected {problem}" if problem else None

    @classmethod
    def from_config(
        cls, dataset: Any, config: Config | Mapping[str, Any], *, train: bool, **overrides: Any
    ) -> Pipeline:
        """The pipeline the config describes (``overrides`` win); ``seq_ordering`` only in training."""
        cfg = config if isinstance(config, Config) else Config(config)
        extern_data = overrides.pop("extern_data", cfg.typed_value("extern_data"))
        seq_indices = overrides.pop("seq_indices", None)
        return cls(dataset, options=PipelineOptions.read(cfg, train=train), extern_data=extern_data, train=train,
                   seq_indices=seq_indices, **overrides)

    # ---- planning --------------------------------------------------------------------

    def _seq_lengths(self) -> dict[str, np.ndarray]:
        if self._lengths is None:
            lengths = _all_lengths(self.dataset)
            if self.extern_data is not None:  # declared static keys (shape (3,)) have no time axis
                lengths = {
                    k: v
                    for k, v in lengths.items()
                    if k not in self.extern_data or self.extern_data[k].has_time
                }
            self._lengths = lengths
        return self._lengths

    def _order(self, epoch: int) -> np.ndarray:
        ds = self.dataset
        n = len(ds)
        # RETURNN's order seed: the dataset's offset (kit's older name: random_seed), not the config's random_seed
        offset = getattr(ds, "random_seed_offset", None)
        seed = int(offset if offset is not None else getattr(ds, "random_seed", None) or 0)
        fixed = getattr(ds, "fixed_random_seed", None)
        method = self.seq_ordering or getattr(ds, "seq_ordering", "default")
        if self.seq_indices is not None:
            bad = [i for i in self.seq_indices if not 0 <= i < n]
            if bad:
                raise DataError(
                    f"seq_indices {bad[:5]} are out of range for dataset {_describe(ds)} ({n} seqs)"
                )
            lens = lambda: ordering_lengths(self._seq_lengths())  # noqa: E731
            full = ordering.full_order(method, n, epoch, lens, seed, fixed_random_seed=fixed)
            return full[np.isin(full, self.seq_indices)].astype(np.int64, copy=False)
        if isinstance(ds, Dataset):
            if type(ds).get_seq_order is Dataset.get_seq_order:
                return ds.seq_order_array(epoch, seq_ordering=self.seq_ordering)
            order = ds.get_seq_order(epoch, seq_ordering=self.seq_ordering, random_seed=self.random_seed)
            return np.asarray(order, dtype=np.int64)
        if self.seq_ordering is None:
            return np.asarray(list(ds.get_seq_order(epoch)), dtype=np.int64)
        return ordering.seq_order_array(
            method,
            num_seqs=n,
            epoch=epoch,
            seq_len=lambda: ordering_lengths(self._seq_lengths()),
            random_seed=seed,
            partition_epoch=getattr(ds, "partition_epoch", 1),
            fixed_random_seed=fixed,
        )

    def set_epoch(self, epoch: int) -> None:
        """Plan the batches of ``epoch`` (1-based) and go to its start."""
        if not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"epochs count from 1, got {epoch!r}")
        self._drop_iter()
        if isinstance(self.dataset, Dataset) and self.dataset.init_epoch(epoch):
            self._renew_dataset_state()
        name = _describe(self.dataset)
        if len(self.dataset) == 0:
            raise DataError(
                f"dataset {name} is empty (0 sequences): nothing to {'train' if self.train else 'evaluate'} on"
            )
        order = self._order(epoch)
        if not len(order):
            raise DataError(f"dataset {name}: epoch {epoch} has no sequences (partition_epoch / seq_indices)")
        if isinstance(self.dataset, Dataset) and self.dataset.set_epoch_order(order):
            self._renew_loaders()  # the sequences depend on the epoch's order (shuffle_frames_of_nseqs)
        entries = self._plan_entries(order, epoch, name)
        if self._batcher is not None:  # the user's batcher, on this thread (see kit.data.custom_batching)
            from kit.data import custom_batching

            stream = custom_batching.SequenceStream(self.dataset, entries, order, epoch)
            entries, ranges, self._fracs, self._batcher_datapipe = custom_batching.plan(self._batcher, stream, name)
        else:
            ranges = self._plan_ranges(entries, order, epoch)
            # complete_frac by position: it stays in order when the batches are shuffled (as in RETURNN)
            self._fracs = batching.complete_fracs(order, entries.seq_idx, ranges)
        if self.shuffle_buffer is not None:
            ranges = batching.shuffle_in_blocks(ranges, self.shuffle_buffer, self.random_seed * 1_000_003 + epoch)
        self._entries, self._ranges = entries, ranges
        self.epoch, self.position = epoch, 0

    def _plan_ranges(self, entries: batching.EpochEntries, order: np.ndarray, epoch: int) -> list[tuple[int, int]]:
        """kit's greedy batches over ``entries`` (``batch_size``, ``max_seqs``, ``packed_batch_size`` / ``_cost``)."""
        lens = batching.span_lengths(entries.seq_idx, entries.spans, self._seq_lengths())
        if callable(self.batch_size) or callable(self.max_seqs):  # RETURNN's limits per sequence
            return batching.plan_batches_by_seq(lens, entries.seq_idx, order, epoch, self.batch_size, self.max_seqs)
        return batching.plan_batches(lens, len(entries), self.batch_size, self.max_seqs, self.packed_batch_size,
                                     self.packed_batch_cost)

    def _plan_entries(self, order: np.ndarray, epoch: int, name: str) -> batching.EpochEntries:
        """``order`` filtered by length and cut into chunks, with numpy operations over the whole epoch."""
        if len(order) and (int(order.min()) < 0 or int(order.max()) >= len(self.dataset)):
            bad = order[(order < 0) | (order >= len(self.dataset))][:5].tolist()
            raise DataError(
                f"dataset {name}: epoch {epoch}'s order has indices {bad} out of range [0, {len(self.dataset)})"
            )
        lengths = self._seq_lengths()
        kept = batching.length_filter(order, lengths, self.min_seq_length, self.max_seq_length)
        if not len(kept):
            raise DataError(
                f"dataset {name}: all {len(order)} sequences of epoch {epoch} were removed by "
                f"min_seq_length={self.min_seq_length!r} / max_seq_length={self.max_seq_length!r}"
            )
        sizes, steps = batching.parse_chunking(self.chunking, list(lengths))
        seq_idx, spans = batching.chunk_arrays(
            kept, lengths, sizes, steps, self.min_chunk_size, self.dataset.get_seq_tag
        )
        if not len(seq_idx):
            raise DataError(
                f"dataset {name}: min_chunk_size={self.min_chunk_size!r} removed every chunk of epoch {epoch}"
            )
        return batching.EpochEntries(seq_idx, spans)

    def _renew_dataset_state(self) -> None:
        """The dataset's sequences changed for this epoch (``Dataset.init_epoch``): drop what was read of them."""
        self._lengths = None
        self._renew_loaders()

    def _renew_loaders(self) -> None:
        """The dataset's state changed: new loaders (workers with a copy of the new state), nothing read kept."""
        self._loader = BatchLoader(self.dataset, self.extern_data)
        self._ahead.clear()
        if self._pool is not None:  # persistent workers hold a copy of the old dataset state
            self._pool.close()
            self._pool = WorkerPool(self._loader, self.num_workers, self._pool_opts)

    def _ensure_planned(self) -> list[tuple[int, int]]:
        """The current epoch's batch ranges (planned now if not yet)."""
        if self._ranges is None:
            self.set_epoch(self.epoch or 1)
        assert self._ranges is not None
        return self._ranges

    @property
    def num_batches(self) -> int:
        return len(self._ensure_planned())

    def __len__(self) -> int:
        return self.num_batches

    def plan(self) -> list[list[batching.Entry]]:
        """The current epoch's batches as lists of ``(seq_idx, spans)`` entries (see batching)."""
        ranges = self._ensure_planned()  # first: planning replaces self._entries
        return self._entries.entries(ranges)

    # ---- iteration -------------------------------------------------------------------

    def __iter__(self) -> Pipeline:
        return self

    def __next__(self) -> Batch:
        ranges = self._ensure_planned()
        b = self.position
        if b >= len(ranges):
            self._drop_iter()
            raise StopIteration
        if self._pool is None:
            batch = self._next_loaded(ranges, b)
        else:
            if self._iter is None:
                self._iter = self._pool.start([(i, self._entries.batch(*ranges[i])) for i in range(b, len(ranges))])
            batch = next(self._iter)
        batch.epoch, batch.batch_idx, batch.complete_frac = self.epoch, b, self._fracs[b]
        self.position = b + 1
        return batch

    def _next_loaded(self, ranges: list[tuple[int, int]], b: int) -> Batch:
        """Batch ``b``: from the prefetch thread, else loaded now (and the thread started for the next ones:
        the first batch does not wait for a thread, and the thread never loads while this one does)."""
        load = partial(LoadAhead.load, self._ahead, self._loader, self._entries, ranges)  # no self: GC closes
        if self._prefetch is not None:
            batch = self._prefetch.take(b)
            if batch is not None:
                return batch
            self._stop_prefetch()  # stopped, or failed on this batch: load it here (and raise, as without it)
        batch = load(b)
        if self.prefetching:
            if b + 1 < len(ranges):
                self._prefetch = Prefetch(load, b + 1, len(ranges), self.options.prefetch, pin=self.options.pin_memory)
            if self.options.pin_memory:
                batch = batch.pin_memory()
        return batch

    def _stop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None

    def _drop_iter(self) -> None:
        self._stop_prefetch()  # before the plan or the loader change under it
        self._iter = None  # a persistent DataLoader resets its workers on the next iter()
        self._ahead.clear()

    # ---- state -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_batches": len(self._ranges or [])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state``'s epoch and position: the remaining batches come next."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 1:  # saved before the first set_epoch
            self.epoch, self.position, self._ranges = 0, 0, None
            return
        self.set_epoch(epoch)
        num_batches = len(self._ensure_planned())
        saved = state.get("num_batches")
        if saved and saved != num_batches:
            raise DataError(
                f"cannot resume the data position: epoch {epoch} had {saved} batches when saved, now "
                f"{num_batches} (dataset, ordering or batch settings changed)"
            )
        if not 0 <= position <= num_batches:
            raise DataError(f"cannot resume at position {position}: epoch {epoch} has {num_batches} batches")
        self.position = position

    def close(self) -> None:
        """Stop the prefetch thread and the worker processes (also done on garbage collection)."""
        self._stop_prefetch()
        self._iter = None
        if self._pool is not None:
            self._pool.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - interpreter shutdown; nothing left to report to
            pass

    def __repr__(self) -> str:
        n = len(self._ranges) if self._ranges is not None else "?"
        return (
            f"Pipeline({_describe(self.dataset)}, epoch={self.epoch}, position={self.position}/{n}, "
            f"train={self.train}, workers={self.num_workers}, prefetch={self.prefetching})"
        )


_PIPELINE_ONLY = ("num_workers", "dataloader_opts", "seq_indices", "prefetch")


def batches(
    dataset: Any,
    *,
    epoch: int = 1,
    extern_data: Mapping[str, Any] | None = None,
    train: bool = True,
    **config_keys: Any,
) -> Pipeline:
    """The batches of one epoch, exactly as training (``train=True``) or eval would see them.

    ``config_keys`` are config keys (``batch_size=``, ``chunking=``, ...), validated like a
    config: unknown keys raise ConfigError with a suggestion. ``num_workers``,
    ``dataloader_opts``, ``prefetch`` and ``seq_indices`` are passed to the Pipeline.

    >>> for batch in batches(Task12AXDataset(100), batch_size=1000, seq_ordering="laplace:.10"):
    ...     print(batch["data"].shape)
    """
    extra = {k: config_keys.pop(k) for k in _PIPELINE_ONLY if k in config_keys}
    config = Config(**config_keys)
    if extern_data is not None:
        extra["extern_data"] = extern_data
    pipe = Pipeline.from_config(dataset, config, train=train, **extra)
    pipe.set_epoch(epoch)
    return pipe
