"""What every tracker shares: the events it listens to, the metric names, the log interval, the rank rule.

A tracker is an event-bus subscriber (never a part of the loop): ``step_end`` gives the train losses
and learning rate of every ``log_every_n_train_steps``-th step, ``epoch_end`` the epoch's score row,
``run_end`` a flush. Metric names follow RETURNN's W&B logging (``returnn/torch/engine.py``):

- per step: ``train_step/<loss>`` and ``train_step/learning_rate`` at the global train step;
- per epoch: ``train/<loss>``, ``<dataset>/<loss>`` (``dev/ce``) and ``learning_rate`` at the global
  train step of the epoch end, with the epoch.

Score names keep RETURNN's form (``ce:exp``, ``grad_norm:p2``); a tracker whose backend refuses a
character maps it in its own ``log_metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kit.errors import ConfigError

logger = logging.getLogger("kit")

DEFAULT_LOG_EVERY = 100  # RETURNN's default for tensorboard_opts / wandb_opts


def step_metrics(losses: Mapping[str, float], learning_rate: float) -> dict[str, float]:
    """One step's metrics under RETURNN's W&B names."""
    return {**{f"train_step/{k}": float(v) for k, v in losses.items()}, "train_step/learning_rate": float(learning_rate)}


def epoch_metrics(scores: Mapping[str, Any]) -> dict[str, float]:
    """An epoch's score row (``train_loss_ce``, ``dev_loss_ce``, ``learning_rate``) under RETURNN's W&B names."""
    from kit.scores import split_score_key

    out: dict[str, float] = {}
    for key, value in scores.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key == "learning_rate":
            out["learning_rate"] = float(value)
        else:
            dataset, name = split_score_key(key)
            out[f"{dataset}/{name}"] = float(value)
    return out


def log_every_option(opts: Mapping[str, Any], key: str) -> int:
    """``log_every_n_train_steps`` of a tracker's option dict (RETURNN's default 100), checked."""
    every = opts.get("log_every_n_train_steps", DEFAULT_LOG_EVERY)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"config key '{key}': log_every_n_train_steps must be a positive int, got {every!r}")
    return every


class Tracker:
    """Base of the trackers: subscribes on :meth:`attach`, calls :meth:`log_metrics`; :meth:`close` detaches.

    Subclasses implement :meth:`log_metrics` (and :meth:`flush` / :meth:`finish` where their backend
    buffers). ``log_every_n_train_steps``: step metrics of every this-many-th global step.
    """

    name = "tracker"

    def __init__(self, *, log_every_n_train_steps: int = DEFAULT_LOG_EVERY):
        self.log_every = log_every_n_train_steps
        self._events: Any = None
        self._global_step: Callable[[], int] = lambda: 0
        self._failed = False

    def attach(self, events: Any, global_step: Callable[[], int]) -> Tracker:
        """Subscribe to ``events``; ``global_step()`` gives the x of epoch metrics."""
        self._events, self._global_step = events, global_step
        for event, fn in self._handlers():
            events.on(event, fn)
        return self

    def _handlers(self) -> list[tuple[str, Callable[..., Any]]]:
        return [("step_end", self.on_step_end), ("epoch_end", self.on_epoch_end), ("run_end", self.on_run_end)]

    def on_step_end(self, result: Any, **_: Any) -> None:
        step = result.global_train_step
        if step % self.log_every:
            return
        # one device→host read of this step's losses per log interval (not per step)
        self.log_metrics(step_metrics(result.losses, result.learning_rate), step=step, epoch=result.epoch)

    def on_epoch_end(self, epoch: int, scores: Mapping[str, Any], **_: Any) -> None:
        self.log_metrics(epoch_metrics(scores), step=int(self._global_step()), epoch=epoch)
        self.flush()  # an epoch's metrics are stored when its score row is

    def on_run_end(self, outcome: str, **_: Any) -> None:
        self._failed = outcome == "failed"
        self.flush()

    def log_metrics(self, metrics: Mapping[str, float], *, step: int, epoch: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged readable now (default: nothing buffered)."""

    def finish(self, *, failed: bool) -> None:
        """End the tracker's run (default: flush)."""
        self.flush()

    def close(self) -> None:
        """Detach from the events and end the run (``failed`` when the last driver call failed)."""
        if self._events is not None:
            for event, fn in self._handlers():
                self._events.off(event, fn)
            self._events = None
            self.finish(failed=self._failed)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} every {self.log_every} steps>"
