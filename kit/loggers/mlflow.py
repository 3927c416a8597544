"""MLflow (``mlflow_opts``): step and epoch metrics, and the config's plain values as parameters.

Options (all optional): ``tracking_uri`` (default: a local SQLite store ``{model}.mlflow.db`` beside the
checkpoints, else MLflow's own default), ``experiment_name`` (default ``"kit"``), ``run_name``, ``run_id`` (continue
that run), ``tags`` (dict), ``log_params`` (default True), ``log_every_n_train_steps`` (default 100),
``all_ranks``. The run is MLflow's client API (``MlflowClient``): no process-global active run is touched,
so a notebook's own ``mlflow.start_run`` stays its own.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from kit.errors import ConfigError
from kit.loggers.base import Tracker, log_every_option

logger = logging.getLogger("kit")

OPTION_KEYS = ("tracking_uri", "experiment_name", "run_name", "run_id", "tags", "log_params",
               "log_every_n_train_steps", "all_ranks")
_BAD_CHARS = re.compile(r"[^\w\-./ ]" if os.name == "nt" else r"[^\w\-./ :]")  # what MLflow accepts in names


def metric_name(name: str) -> str:
    """MLflow's form of a metric name: characters it refuses (``:`` on Windows) become ``_``."""
    return _BAD_CHARS.sub("_", name)


def default_tracking_uri(model_prefix: str | None) -> str | None:
    """A local SQLite store ``{model}.mlflow.db`` beside the checkpoints (MLflow 3 keeps its file store in
    maintenance mode); None (MLflow's own default) without ``model``."""
    return f"sqlite:///{os.path.abspath(model_prefix)}.mlflow.db" if model_prefix else None


class MlflowLogger(Tracker):
    """Logs to one MLflow run through ``MlflowClient``; :meth:`close` ends it (FINISHED or FAILED)."""

    name = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, experiment_name: str = "kit", run_name: str | None = None,
                 run_id: str | None = None, tags: Mapping[str, str] | None = None,
                 params: Mapping[str, Any] | None = None, log_every_n_train_steps: int = 100):
        super().__init__(log_every_n_train_steps=log_every_n_train_steps)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError(f"config key 'mlflow_opts': {exc}; pip install 'kit-train[mlflow]'") from None
        self.client = MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment_name)
            run = self.client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
            self.run_id = run.info.run_id
            if params:
                self._log_params(params)
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        self.tracking_uri = tracking_uri
        logger.info("MLflow: logging to run %s (%s)", self.run_id, tracking_uri or "MLflow's default store")

    @classmethod
    def from_options(cls, opts: Any, model_prefix: str | None, params: Mapping[str, Any] | None = None) -> MlflowLogger:
        if opts is True:
            opts = {}
        if not isinstance(opts, Mapping) or set(opts) - set(OPTION_KEYS):
            raise ConfigError(f"config key 'mlflow_opts': got {opts!r}, expected a dict with keys among "
                              f"{', '.join(OPTION_KEYS)}")
        return cls(tracking_uri=opts.get("tracking_uri") or default_tracking_uri(model_prefix),
                   experiment_name=opts.get("experiment_name", "kit"), run_name=opts.get("run_name"),
                   run_id=opts.get("run_id"), tags=opts.get("tags"),
                   params=params if opts.get("log_params", True) else None,
                   log_every_n_train_steps=log_every_option(opts, "mlflow_opts"))

    def _log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(metric_name(k), str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], *, step: int, epoch: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_name(k), float(v), now, step) for k, v in {**metrics, "epoch": epoch}.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
