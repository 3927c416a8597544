"""Trackers: TensorBoard, Weights & Biases, MLflow and CSV, each an event-bus subscriber, each opt-in.

A tracker runs only when a config key asks for it (``use_tensorboard``, ``wandb_opts``, ``mlflow_opts``,
``csv_log``) or a notebook calls ``session.log_to("wandb", ...)`` — never because its package is
installed. Under torchrun only rank 0 logs, unless the tracker's options say ``all_ranks=True`` (each
other rank then writes beside rank 0's files, ``.rank<r>`` added to the default names).
See docs/trackers.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kit.errors import ConfigError
from kit.loggers.base import Tracker, epoch_metrics, step_metrics

__all__ = ["KINDS", "Tracker", "config_trackers", "epoch_metrics", "make_tracker", "step_metrics", "tracker_params"]

KINDS = ("tensorboard", "wandb", "mlflow", "csv")
CONFIG_KEYS = {"tensorboard": "tensorboard_opts", "wandb": "wandb_opts", "mlflow": "mlflow_opts", "csv": "csv_log"}


def tracker_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's plain values (numbers, strings, bools; no functions or datasets): a run's parameters."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool)) and v is not None}


def make_tracker(kind: str, opts: Any, *, model_prefix: str | None, task: str = "train",
                 config_file: str | None = None, params: Mapping[str, Any] | None = None, rank: int = 0) -> Tracker:
    """A tracker of ``kind`` (one of :data:`KINDS`) from its options, not yet attached."""
    if kind == "tensorboard":
        from kit.loggers.tensorboard import TensorBoardLogger

        return TensorBoardLogger.from_options({k: v for k, v in dict(opts or {}).items() if k != "all_ranks"},
                                              model_prefix)
    if kind == "wandb":
        from kit.loggers.wandb import WandbLogger

        return WandbLogger.from_options(opts, task=task, config_file=config_file, params=params, rank=rank)
    if kind == "mlflow":
        from kit.loggers.mlflow import MlflowLogger

        return MlflowLogger.from_options(opts, model_prefix, params=params)
    if kind == "csv":
        from kit.loggers.csv import CsvLogger

        return CsvLogger.from_options(opts, model_prefix)
    raise ConfigError(f"unknown tracker {kind!r}; known: {', '.join(KINDS)}")


def _wanted(config: Any) -> dict[str, Any]:
    """Tracker kind -> options, for the trackers the config turns on."""
    wanted: dict[str, Any] = {}
    if config.bool("use_tensorboard"):
        wanted["tensorboard"] = config.typed_value("tensorboard_opts") or {}
    for kind in ("wandb", "mlflow", "csv"):
        value = config.typed_value(CONFIG_KEYS[kind])
        if value is not None and value is not False:
            wanted[kind] = value
    return wanted


def config_trackers(config: Any, events: Any, *, training: bool, rank: int,
                    step: Callable[[], int]) -> list[Tracker]:
    """The trackers the config asks for, attached to ``events`` (training only; rank 0 unless ``all_ranks``)."""
    if not training:
        return []
    out: list[Tracker] = []
    model = config.typed_value("model")
    for kind, opts in _wanted(config).items():
        if rank and not (isinstance(opts, Mapping) and opts.get("all_ranks")):
            continue
        prefix = f"{model}.rank{rank}" if rank and model else model
        out.append(make_tracker(kind, opts, model_prefix=prefix, task="train", config_file=config.source,
                                params=tracker_params(config), rank=rank).attach(events, step))
    return out
