"""``PipelineOptions``: a pipeline's settings, read from a validated :class:`kit.Config`.

The defaults are the key registry's (:mod:`kit.config.keys`) and nowhere else, so a ``Pipeline``
built by hand and one built from a config agree (``chunking_in_eval``, ``random_seed``,
``data_prefetch``).

>>> opts = PipelineOptions.read(Config(batch_size=2000), train=True)
>>> opts.replace(max_seqs=8).max_seqs
8
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kit.config import Config
from kit.config.keys import KEYS
from kit.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """What a :class:`kit.data.Pipeline` does with its dataset (config key names and meanings).

    ``seq_ordering`` and ``online_shuffle_batches`` are read for training only (eval and forward
    keep the dataset's order); ``chunking`` applies in eval when ``chunking_in_eval``. ``prefetch``
    is ``data_prefetch``: batches loaded ahead on a background thread (0: on the caller's thread).
    ``pin_memory``: the prefetch thread pins the batches (for ``non_blocking`` copies to CUDA).
    """

    batch_size: Any  # int, per-key dict, or RETURNN's callable (batch_size_train / batch_size_dev win)
    max_seqs: Any  # int or a callable
    min_seq_length: int | Mapping[str, int] | None
    max_seq_length: int | Mapping[str, int] | None
    chunking: Any
    min_chunk_size: int | Mapping[str, int] | None
    chunking_in_eval: bool
    seq_ordering: str | None
    online_shuffle_batches: int | Mapping[str, int] | None
    random_seed: int
    num_workers: int
    dataloader_opts: Mapping[str, Any]
    prefetch: int
    pin_memory: bool = False
    packed_batch_size: int | Mapping[str, int] | None = None  # RETURNN's: a budget of summed lengths
    packed_batch_cost: Mapping[str, Any] | None = None  # RETURNN's: name -> f(lengths), bounded by packed_batch_size
    torch_batching: Any = None  # RETURNN's: a batcher over the streamed sequences (kit.data.custom_batching)

    @classmethod
    def read(cls, config: Config | Mapping[str, Any] | None = None, *, train: bool = True) -> PipelineOptions:
        """The options ``config`` (validated; None: the defaults) gives a training or eval pipeline."""
        cfg = config if isinstance(config, Config) else Config(dict(config or {}))
        loader_opts = dict(cfg.typed_value("torch_dataloader_opts") or {})
        return cls(
            batch_size=_batch_size(cfg, train),
            max_seqs=cfg.typed_value("max_seqs"),
            min_seq_length=cfg.typed_value("min_seq_length"),
            max_seq_length=cfg.typed_value("max_seq_length"),
            chunking=cfg.typed_value("chunking"),
            min_chunk_size=cfg.typed_value("min_chunk_size"),
            chunking_in_eval=bool(cfg.typed_value("chunking_in_eval")),
            seq_ordering=cfg.typed_value("seq_ordering") if train else None,
            online_shuffle_batches=cfg.typed_value("online_shuffle_batches") if train else None,
            random_seed=int(cfg.typed_value("random_seed")),
            num_workers=int(loader_opts.pop("num_workers", 0) or 0),
            dataloader_opts=loader_opts,
            prefetch=int(cfg.typed_value("data_prefetch")),
            pin_memory=_pins(cfg.typed_value("device")),
            packed_batch_size=_per_split(cfg, "packed_batch_size", train),
            packed_batch_cost=_per_split(cfg, "packed_batch_cost", train),
            torch_batching=cfg.typed_value("torch_batching"),
        )

    def replace(self, **changes: Any) -> PipelineOptions:
        """These options with ``changes`` (config keys are validated as in a config)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ConfigError(f"pipeline options: unknown {unknown}; known: {sorted(fields)}")
        for name, value in changes.items():
            key = KEYS.get("data_prefetch" if name == "prefetch" else name)
            if key is not None and key.check is not None and value is not None:
                problem = key.check(value)
                if problem:
                    raise ConfigError(f"{name}: got {value!r}, expected {problem}")
        if "dataloader_opts" in changes:
            opts = dict(changes["dataloader_opts"] or {})
            workers = opts.pop("num_workers", None)
            changes["dataloader_opts"] = opts
            if workers and not changes.get("num_workers"):
                changes["num_workers"] = int(workers)
        if "num_workers" in changes:
            changes["num_workers"] = int(changes["num_workers"] or 0)
        return dataclasses.replace(self, **changes)


def _batch_size(config: Config, train: bool) -> Any:
    """``batch_size_train`` (training) or ``batch_size_dev`` (evaluation, forwarding) when set, else
    ``batch_size``: RETURNN's choice."""
    own = config.typed_value("batch_size_train" if train else "batch_size_dev")
    return own if own is not None else config.typed_value("batch_size")


def _per_split(config: Config, name: str, train: bool) -> Any:
    """``<name>_train`` (training) or ``<name>_dev`` (evaluation, forwarding) when set, else ``name``
    (RETURNN's rule for ``packed_batch_size`` and ``packed_batch_cost``)."""
    own = config.typed_value(f"{name}_train" if train else f"{name}_dev")
    return own if own is not None else config.typed_value(name)


def _pins(device: Any) -> bool:
    """Pin batches when training will run on CUDA (``device`` None picks CUDA first when there is one)."""
    import torch

    if not torch.cuda.is_available():
        return False
    return device is None or str(device).startswith(("cuda", "gpu"))
