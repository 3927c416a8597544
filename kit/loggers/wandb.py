"""Weights & Biases (``wandb_opts``), as RETURNN's torch engine logs to it.

``wandb_opts`` is passed to ``wandb.init`` except ``log_every_n_train_steps`` (default 100) and kit's
``all_ranks``. As RETURNN: ``job_type`` defaults to the task, ``id`` to a hash of the task and the config
file's absolute path (so a restarted job continues the same W&B run; not when ``WANDB_RUN_ID`` is set),
``name`` to ``$SLURM_JOB_NAME``, ``resume`` to ``"allow"``. Every metric is logged with the epoch, at the
global train step. Offline: ``WANDB_MODE=offline`` (or ``wandb_opts={'mode': 'offline'}``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from kit.errors import ConfigError
from kit.loggers.base import Tracker, log_every_option

logger = logging.getLogger("kit")

KIT_OPTIONS = ("log_every_n_train_steps", "all_ranks")


def init_options(opts: Mapping[str, Any], *, task: str, config_file: str | None, rank: int = 0) -> dict[str, Any]:
    """The ``wandb.init`` arguments RETURNN derives from ``wandb_opts`` (a rank other than 0, with
    ``all_ranks``: its own run, ``-rank<r>`` after the id)."""
    init = {k: v for k, v in opts.items() if k not in KIT_OPTIONS}
    init.setdefault("job_type", task)
    if config_file and not os.environ.get("WANDB_RUN_ID"):
        run_key = (task, [os.path.abspath(config_file)])
        init.setdefault("id", hashlib.sha256(repr(run_key).encode("utf-8")).hexdigest())
    if os.environ.get("SLURM_JOB_NAME"):
        init.setdefault("name", os.environ["SLURM_JOB_NAME"])
    if rank and init.get("id"):
        init["id"] = f"{init['id']}-rank{rank}"
    if not any(k in init for k in ("resume", "resume_from", "fork_from")):  # W&B takes one of them
        init.setdefault("resume", "allow")
    if task == "train" and not (init.get("id") or os.environ.get("WANDB_RUN_ID")):
        logger.warning("wandb_opts: no run 'id' given, a restarted job will create a new W&B run; set a fixed "
                       "'id' (e.g. the job's hash) to continue the same run")
    return init


class WandbLogger(Tracker):
    """Logs step and epoch metrics to a W&B run (``wandb.init(**init)``); :meth:`close` finishes the run."""

    name = "wandb"

    def __init__(self, init: Mapping[str, Any], *, log_every_n_train_steps: int = 100,
                 config: Mapping[str, Any] | None = None):
        super().__init__(log_every_n_train_steps=log_every_n_train_steps)
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(f"config key 'wandb_opts': {exc}; pip install 'kit-train[wandb]'") from None
        kwargs = dict(init)
        if config is not None and "config" not in kwargs:
            kwargs["config"] = dict(config)
        self.run = wandb.init(**kwargs)
        logger.info("W&B: logging to run %s (%s)", self.run.id, getattr(self.run, "dir", ""))

    @classmethod
    def from_options(cls, opts: Any, *, task: str, config_file: str | None,
                     params: Mapping[str, Any] | None = None, rank: int = 0) -> WandbLogger:
        if not isinstance(opts, Mapping):
            raise ConfigError(f"config key 'wandb_opts': got {opts!r}, expected a dict of wandb.init arguments "
                              "(and 'log_every_n_train_steps')")
        return cls(init_options(opts, task=task, config_file=config_file, rank=rank),
                   log_every_n_train_steps=log_every_option(opts, "wandb_opts"), config=params)

    def log_metrics(self, metrics: Mapping[str, float], *, step: int, epoch: int) -> None:
        self.run.log({**metrics, "epoch": epoch}, step=step)

    def finish(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
