"""The parts a config names, built once per engine (datasets, ``extern_data``, the score table, the model),
and the containers the engine hands its collaborators (:class:`Built`, :class:`Training`).

Datasets are keyed by their config key (``train``, ``dev``, ``eval``) and
``eval_datasets.<name>``; :func:`eval_datasets` gives the name → dataset map of the
datasets evaluated after each epoch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kit.compat.seeding import seed_returnn_frontend
from kit.config import Config
from kit.engine.accounting import EpochAccounting
from kit.engine.user_code import call_user
from kit.errors import ConfigError
from kit.rng import model_init_seed, seed_all

if TYPE_CHECKING:
    from kit.data.batch import Batch
    from kit.data.extern_data import ExternData
    from kit.data.pipeline import Pipeline
    from kit.engine.compute import Compute
    from kit.engine.distributed import DistributedContext
    from kit.engine.guard import NonFiniteGuard
    from kit.engine.memory import MemoryMeter
    from kit.engine.schedule import Schedule
    from kit.engine.updater import Updater
    from kit.rng import RngState
    from kit.scores import ScoreTable


def build_datasets(config: Config) -> dict[str, Any]:
    from kit.data import make_dataset

    out: dict[str, Any] = {}
    for key in ("train", "dev", "eval"):
        value = config.typed_value(key)
        if value is not None:
            out[key] = _make(make_dataset, value, key, evaluated=key != "train", config=config)
    for name, value in (config.typed_value("eval_datasets") or {}).items():
        where = f"eval_datasets[{name!r}]"
        out[f"eval_datasets.{name}"] = _make(make_dataset, value, where, evaluated=True, config=config)
    return out


def _make(make_dataset: Any, value: Any, key: str, *, evaluated: bool, config: Config) -> Any:
    from kit.data.returnn_adapter import EVAL_DEFAULTS

    # RETURNN's Dataset defaults (kwargs_update_from_config); its eval defaults set shuffle_frames_of_nseqs = 0
    given = {"window": config.typed_value("window"),
             "shuffle_frames_of_nseqs": None if evaluated else (config.typed_value("shuffle_frames_of_nseqs") or None)}
    try:
        return make_dataset(value, returnn_defaults=EVAL_DEFAULTS if evaluated else None, config_defaults=given)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"config key '{key}': {exc}") from None


def eval_datasets(datasets: dict[str, Any]) -> dict[str, Any]:
    """Name → dataset for the datasets evaluated after each epoch (dev, eval, eval_datasets)."""
    out = {k: v for k, v in datasets.items() if k in ("dev", "eval")}
    out.update({k.split(".", 1)[1]: v for k, v in datasets.items() if k.startswith("eval_datasets.")})
    return out


def build_extern_data(config: Config) -> Any:
    spec = config.typed_value("extern_data")
    if spec is None:
        return None
    from kit.data import ExternData

    return ExternData(spec)


def score_file_path(config: Config) -> str | None:
    path = config.typed_value("learning_rate_file")
    if path:
        return path
    prefix = config.typed_value("model")
    return f"{prefix}.scores.json" if prefix else None


def open_score_table(config: Config) -> Any:
    from kit.scores import ScoreTable

    if config.typed_value("learning_rate_file"):  # RETURNN's format stays RETURNN's; kit's JSON beside it
        from kit.compat.returnn_run import ReturnnScoreTable
        from kit.compat.run_files import returnn_layout

        return ReturnnScoreTable.open(config.typed_value("learning_rate_file"), side_table=not returnn_layout(config))
    path = score_file_path(config)
    if path and os.path.exists(path):
        return ScoreTable.load(path)
    return ScoreTable(path)


def create_model(config: Config, device: torch.device, epoch: int, step: int) -> torch.nn.Module:
    """``get_model(epoch=, step=)`` under RETURNN's init seed (the same init for the same position), on ``device``."""
    get_model = config.typed_value("get_model")
    if get_model is None:
        raise ConfigError("config key 'get_model' is not set: expected get_model(*, epoch, step, **kwargs)")
    seed = model_init_seed(config.int("random_seed"), epoch, step)
    seed_all(seed)
    seed_returnn_frontend(seed)  # rf.Module parameters: RETURNN's initial weights
    model = call_user(get_model, "get_model", epoch=epoch, step=step)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"config key 'get_model': returned {type(model).__name__}, expected a torch.nn.Module")
    return model.to(device)


# ---- the engine's parts, as its collaborators receive them -------------------------------------


@dataclass
class Built:
    """What the engine's set-up builds, for every task (train, eval, forward)."""

    device: torch.device
    dist: DistributedContext | None
    memory: MemoryMeter
    datasets: dict[str, Any]
    extern_data: ExternData | None
    scores: ScoreTable
    model: torch.nn.Module
    compute: Compute

    @property
    def dist_is_main(self) -> bool:
        """This process writes the files (the only one, or rank 0 under torchrun)."""
        return self.dist is None or self.dist.is_main


@dataclass
class Training:
    """What training adds to :class:`Built`; the running epoch's loss sums and the last step's batch and RNG."""

    updater: Updater
    schedule: Schedule
    pipeline: Pipeline
    guard: NonFiniteGuard
    accounting: EpochAccounting = field(default_factory=EpochAccounting)
    last_batch: Batch | None = None  # a reference only: a break point's context reads it
    step_rng: RngState | None = None  # torch's RNG before the last step's user code (when a debugger may replay)
