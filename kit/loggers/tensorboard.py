"""TensorBoard event files from the engine's events (RETURNN's ``use_tensorboard`` / ``tensorboard_opts``).

A subscriber like any view: the loop does not know it. It writes

- ``train/<loss>`` and ``train/learning_rate`` every ``log_every_n_train_steps`` steps
  (RETURNN's tags, at the global train step),
- ``<dataset>/<score>`` for every eval score of an epoch (``dev/ce``; RETURNN's tags, at the
  global train step of the epoch end), and ``train_epoch/<loss>`` / ``train_epoch/learning_rate``
  for the epoch's averaged train losses and its learning rate.

The log dir is ``tensorboard_opts["log_dir"]``; by default ``{model}.tensorboard/`` beside the
checkpoints (RETURNN uses ``SummaryWriter()``'s default ``./runs/<date>_<host>``, which is
also kit's default when ``model`` is not set). Under torchrun only rank 0 writes.
(Moved here from ``kit.tensorboard``, which still imports it.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kit.errors import ConfigError
from kit.loggers.base import DEFAULT_LOG_EVERY, Tracker

logger = logging.getLogger("kit")

OPTION_KEYS = ("log_every_n_train_steps", "log_dir", "all_ranks")


def check_options(value: Any) -> str | None:
    """The config registry's check of ``tensorboard_opts``: a problem string or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "a dict {'log_every_n_train_steps': int, 'log_dir': str}"
    unknown = sorted(set(value) - set(OPTION_KEYS))
    if unknown:
        return f"a dict with keys among {', '.join(OPTION_KEYS)} (unknown: {', '.join(map(repr, unknown))})"
    every = value.get("log_every_n_train_steps", DEFAULT_LOG_EVERY)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        return "log_every_n_train_steps: a positive int"
    if not isinstance(value.get("log_dir", ""), str):
        return "log_dir: a string"
    return None


def default_log_dir(model_prefix: str | None) -> str | None:
    """``{model}.tensorboard`` beside the checkpoints; None (SummaryWriter's ``./runs/...``) without ``model``."""
    return f"{model_prefix}.tensorboard" if model_prefix else None


class TensorBoardLogger(Tracker):
    """Writes scalars on ``step_end`` and ``epoch_end`` under RETURNN's TensorBoard tags; :meth:`close`
    detaches and closes the file.

    Args:
        events: the engine's :class:`kit.events.Events` to subscribe to (None: :meth:`attach` later).
        global_step: returns the current global train step (the x of epoch scalars).
        log_dir: the event file directory (None: SummaryWriter's default).
        log_every_n_train_steps: train scalars every this many steps.
    """

    name = "tensorboard"

    def __init__(self, events: Any = None, global_step: Any = None, *, log_dir: str | None,
                 log_every_n_train_steps: int = DEFAULT_LOG_EVERY):
        super().__init__(log_every_n_train_steps=log_every_n_train_steps)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer needs the tensorboard package
            raise ConfigError(f"config key 'use_tensorboard': {exc}; pip install 'kit-train[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=log_dir)
        self.log_dir: str = self.writer.log_dir
        logger.info("TensorBoard: writing to %s", self.log_dir)
        if events is not None:
            self.attach(events, global_step or (lambda: 0))

    @classmethod
    def from_config(cls, config: Any, events: Any, global_step: Any) -> TensorBoardLogger:
        return cls.from_options(config.typed_value("tensorboard_opts") or {}, config.typed_value("model")).attach(
            events, global_step)  # type: ignore[return-value]

    @classmethod
    def from_options(cls, opts: dict[str, Any], model_prefix: str | None) -> TensorBoardLogger:
        """From ``tensorboard_opts`` (or ``session.log_to("tensorboard", **opts)``), not yet attached."""
        problem = check_options(opts)
        if problem:
            raise ConfigError(f"config key 'tensorboard_opts': got {opts!r}, expected {problem}")
        log_dir = opts.get("log_dir") or default_log_dir(model_prefix)
        return cls(log_dir=log_dir, log_every_n_train_steps=int(opts.get("log_every_n_train_steps", DEFAULT_LOG_EVERY)))

    def on_step_end(self, result: Any, **_: Any) -> None:
        step = result.global_train_step
        if step % self.log_every:
            return
        # one device→host read of this step's losses per log interval (not per step)
        for name, value in result.losses.items():
            self.writer.add_scalar(f"train/{name}", value, global_step=step)
        self.writer.add_scalar("train/learning_rate", result.learning_rate, global_step=step)

    def on_epoch_end(self, epoch: int, scores: Mapping[str, Any], **_: Any) -> None:
        from kit.scores import split_score_key

        step = int(self._global_step())
        for key, value in scores.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key == "learning_rate":
                tag = "train_epoch/learning_rate"
            else:
                dataset, name = split_score_key(key)
                tag = f"train_epoch/{name}" if dataset == "train" else f"{dataset}/{name}"
            self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()  # an epoch's scalars are on disk when its score row is

    def log_metrics(self, metrics: Any, *, step: int, epoch: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, float(value), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def finish(self, *, failed: bool) -> None:
        self.writer.close()
