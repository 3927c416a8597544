"""A CSV file of every logged metric (``csv_log``): the tracker that needs no package and no service.

One row per value, long form, appended (a resumed run continues the same file)::

    time,epoch,global_train_step,name,value
    1733145600.1,1,0,train_step/ce,2.3026

``pandas.read_csv(path).pivot_table(index="global_train_step", columns="name", values="value")`` gives the
wide table. Names as every tracker's (:mod:`kit.loggers.base`). Default file: ``{model}.log.csv`` beside the
checkpoints.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Mapping
from typing import Any

from kit.errors import ConfigError
from kit.loggers.base import Tracker, log_every_option

HEADER = ("time", "epoch", "global_train_step", "name", "value")
OPTION_KEYS = ("path", "log_every_n_train_steps", "all_ranks")


class CsvLogger(Tracker):
    """Appends ``time, epoch, global_train_step, name, value`` rows to ``path``; flushed at epoch ends."""

    name = "csv"

    def __init__(self, path: str | os.PathLike, *, log_every_n_train_steps: int = 100):
        super().__init__(log_every_n_train_steps=log_every_n_train_steps)
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - closed by finish()
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(HEADER)

    @classmethod
    def from_options(cls, opts: Any, model_prefix: str | None) -> CsvLogger:
        """From ``csv_log`` (True, a path, or ``{'path': .., 'log_every_n_train_steps': ..}``)."""
        if opts is True:
            opts = {}
        elif isinstance(opts, (str, os.PathLike)):
            opts = {"path": os.fspath(opts)}
        if not isinstance(opts, Mapping) or set(opts) - set(OPTION_KEYS):
            raise ConfigError(f"config key 'csv_log': got {opts!r}, expected True, a file path, or a dict with keys "
                              f"among {', '.join(OPTION_KEYS)}")
        path = opts.get("path") or (f"{model_prefix}.log.csv" if model_prefix else None)
        if path is None:
            raise ConfigError("config key 'csv_log': no 'path' given and 'model' is not set (the default file is "
                              "{model}.log.csv)")
        return cls(path, log_every_n_train_steps=log_every_option(opts, "csv_log"))

    def log_metrics(self, metrics: Mapping[str, float], *, step: int, epoch: int) -> None:
        now = round(time.time(), 3)
        self._writer.writerows((now, epoch, step, name, repr(float(value))) for name, value in metrics.items())

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def finish(self, *, failed: bool) -> None:
        self._file.close()
