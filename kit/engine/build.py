"""Building an engine's parts from its config: what every task needs (:func:`build_parts`) and what
training adds (:func:`build_training`), in the order that keeps a config error from writing anything."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kit.config import Config
from kit.engine import amp, distributed, parts
from kit.engine import start as start_
from kit.engine.compute import Compute
from kit.engine.device import select_device
from kit.engine.memory import MemoryMeter
from kit.engine.parts import Built, Training
from kit.engine.user_code import check_accepts_kwargs
from kit.errors import ConfigError
from kit.events import Events

if TYPE_CHECKING:
    from kit.checkpoints.lock import PrefixLock

logger = logging.getLogger("kit")


def can_train(config: Config) -> bool:
    return config.typed_value("train") is not None and config.typed_value("train_step") is not None


def build_parts(config: Config, events: Events, *, training: bool,
                shared_process: bool = False) -> tuple[Built, start_.Start, PrefixLock | None]:
    """Device, datasets, score table, the model (resumed or fresh); the prefix lock when training.
    ``shared_process``: the process is not the run's own (a notebook kernel)."""
    device, reason = select_device(config.typed_value("device"))
    dist = distributed.from_config(config, device)
    if dist:  # one process per device (cuda:LOCAL_RANK)
        device, reason = dist.device, f"{reason}; {dist}"
    logger.info("device: %s (%s)", device, reason)
    if device.type == "cuda":  # before the datasets: their worker processes inherit the pinning
        from kit.engine.cpu_affinity import pin_for_engine

        if shared_process and not config.has("gpu_local_cpu_affinity"):
            # RETURNN pins its own process; a kernel's sessions would fight over one process-wide affinity
            logger.info("CPU affinity not set: this process runs other sessions too (a notebook kernel); "
                        "gpu_local_cpu_affinity=True pins it to the CPUs next to %s", device)
        else:
            pin_for_engine(config.bool("gpu_local_cpu_affinity"), device, dist)
    if training:  # the optimizer's class and keywords, before data and model are built
        from kit.engine.optimizer_check import check_optimizer

        check_optimizer(config)
    datasets = parts.build_datasets(config)
    extern_data = parts.build_extern_data(config)
    if training:  # a score the LR control would never find: named now, not after an epoch's training
        from kit.engine.lr_control import check_error_measure

        check_error_measure(config, ["train", *parts.eval_datasets(datasets)])
    lock = None
    prefix = config.typed_value("model")
    if config.bool("dry_run") and training:
        logger.warning("dry_run is set: this run writes nothing (no checkpoint, score file or event log)")
    if prefix and training and (dist is None or dist.is_main) and not config.bool("dry_run"):
        from kit.checkpoints.lock import PrefixLock

        lock = PrefixLock.acquire(prefix)  # 'model' writable and ours, before any file is read or written
    try:
        built, start = _build_model(config, events, training, device, dist, datasets, extern_data)
    except BaseException:
        if lock is not None:  # a run that stops here leaves no lock file (nor a folder it made) behind
            lock.release()
        raise
    return built, start, lock


def _build_model(config: Config, events: Events, training: bool, device: Any, dist: Any, datasets: Any,
                 extern_data: Any) -> tuple[Built, start_.Start]:
    scores = parts.open_score_table(config)
    if (dist and not dist.is_main) or config.bool("dry_run"):  # rank 0 alone writes the score file; dry_run: none
        scores.path = None
    start = start_.find_start(config, scores, training=training)
    start_.warn_config_changes(config, start)
    model = parts.create_model(config, device, start.epoch, start.global_train_step)
    start_.init_weights(config, model, start, training=training)
    float_dtype = amp.cast_to_default_float_dtype(model, config)  # as RETURNN: after loading
    compute = Compute(model, device, events, amp_dtype=amp.amp_dtype(config), float_dtype=float_dtype,
                      grad_scaler=amp.make_grad_scaler(config, device))
    return Built(device, dist, MemoryMeter(device), datasets, extern_data, scores, model, compute), start


def build_training(config: Config, built: Built) -> Training:
    """Optimizer, LR control and schedule, the train pipeline and the non-finite guard."""
    from kit.data.pipeline import Pipeline
    from kit.engine.guard import NonFiniteGuard
    from kit.engine.lr_control import make_lr_control
    from kit.engine.schedule import Schedule
    from kit.engine.updater import Updater

    if config.typed_value("train_step") is None:
        raise ConfigError("config key 'train_step' is not set: expected train_step(*, model, extern_data, **kwargs)")
    check_accepts_kwargs(config.typed_value("train_step"), "train_step")
    if built.datasets.get("train") is None:
        raise ConfigError("config key 'train' is not set: training needs a dataset")
    updater = Updater(config, built.model, grad_scaler=built.compute.grad_scaler is not None)
    lr_control = make_lr_control(config, built.scores)
    make_pipeline = built.dist.pipeline if built.dist else Pipeline.from_config  # a rank's share of each epoch
    pipeline = make_pipeline(built.datasets["train"], config, train=True, extern_data=built.extern_data)
    if built.dist:  # DDP, or every rank starts from rank 0's weights
        built.dist.prepare_model(built.model)
    guard = NonFiniteGuard(built.model, updater.parameters, updater.zero_grad, built.compute.events,
                           checks_gradients=built.compute.grad_scaler is None)
    return Training(updater, Schedule(lr_control, updater), pipeline, guard)


def config_loggers(config: Config, events: Events, training: bool, rank: int, step: Callable[[], int]) -> list[Any]:
    """Trackers that config keys turn on (kit.loggers), for the CLI and a Session alike (training; rank 0
    unless a tracker's options ask for all ranks)."""
    from kit.loggers import config_trackers

    return config_trackers(config, events, training=training, rank=rank, step=step)
