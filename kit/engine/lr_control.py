"""Learning-rate control per epoch (RETURNN's ``LearningRateControl``), stored in the ScoreTable.

>>> control = make_lr_control(Config(learning_rate=1e-3, learning_rate_control="newbob"), scores)
>>> lr = control.learning_rate_for_epoch(epoch)   # stored lr, or computed and stored now

The lr of every epoch is written into the score table when it is first asked for, so the
schedule (newbob included) survives a restart: the table file is the state.

Schemes (``learning_rate_control``), as in RETURNN:

- ``constant``: the lr of the last epoch that has one, else ``learning_rate``.
- ``newbob`` / ``newbob_rel``: from the last two epochs with scores, the relative error change
  ``(new - old) / |new|`` (``/ |old|`` with ``newbob_relative_error_div_by_old``); above
  ``newbob_relative_error_threshold`` → lr × ``learning_rate_decay`` (floored at
  ``min_learning_rate``), else lr × ``learning_rate_growth``.
- ``newbob_abs``: the same with the absolute change and ``newbob_error_threshold``.
- ``newbob_multi_epoch``: the mean relative change over the last ``newbob_multi_num_epochs``
  epochs, checked every ``newbob_multi_update_interval`` epochs (epochs 1, 1+k, 1+2k, ...).

``learning_rates`` (a list from epoch 1, or a dict epoch -> lr that holds from that epoch on)
predefines epochs; a lr already in the table always wins. ``learning_rate_control_min_num_epochs_per_new_lr``
keeps a new lr for at least that many epochs.

Which score newbob looks at: ``learning_rate_control_error_measure`` (or that key + ``_output``);
when unset, ``dev_score`` (RETURNN's name, for legacy tables), else the first non-error
``dev_...`` key in sorted order, else the first non-error key in sorted order, else the first
key in sorted order — with a warning on the ``kit`` logger naming the key picked.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from kit.config import Config
from kit.errors import ConfigError
from kit.scores import ScoreTable

logger = logging.getLogger("kit")

CONTROL_KINDS = {
    "constant": "constant",
    "newbob": "newbob_rel",
    "newbob_rel": "newbob_rel",
    "newbob_relative": "newbob_rel",
    "newbob_abs": "newbob_abs",
    "newbob_multi_epoch": "newbob_multi_epoch",
}


class DynamicLearningRateError(ConfigError, TypeError):
    """Config ``dynamic_learning_rate`` has the wrong signature or returns something that is not a number."""


class LearningRateControl:
    """Computes the lr of each epoch from the stored lrs and scores of the previous epochs."""

    def __init__(self, config: Config, scores: ScoreTable):
        self.config = config
        self.scores = scores
        name = config.typed_value("learning_rate_control") or "constant"
        if name not in CONTROL_KINDS:
            raise ConfigError(
                f"config key 'learning_rate_control': got {name!r}, expected one of {', '.join(CONTROL_KINDS)}"
            )
        self.name = name
        self.kind = CONTROL_KINDS[name]
        self.default_learning_rate = config.float("learning_rate")
        self.min_learning_rate = config.float("min_learning_rate")
        self.predefined = _predefined_learning_rates(config.typed_value("learning_rates"))
        self.error_measure = config.typed_value("learning_rate_control_error_measure")
        self.relative_to_lr = config.bool("learning_rate_control_relative_error_relative_lr")
        self.min_num_epochs_per_new_lr = config.int("learning_rate_control_min_num_epochs_per_new_lr")
        self.relative_error_div_by_old = config.bool("newbob_relative_error_div_by_old")
        self.decay = _factor_setting(config, "learning_rate_decay", "newbob_learning_rate_decay")
        self.growth = _factor_setting(config, "learning_rate_growth", "newbob_learning_rate_growth")
        self.relative_error_threshold = config.float("newbob_relative_error_threshold")
        grow = config.float("newbob_relative_error_grow_threshold")
        self.relative_error_grow_threshold = self.relative_error_threshold if grow is None else float(grow)
        self.error_threshold = config.float("newbob_error_threshold")
        self.multi_num_epochs = config.int("newbob_multi_num_epochs")
        interval = config.int("newbob_multi_update_interval")
        self.multi_update_interval = self.multi_num_epochs if interval is None else int(interval)
        self._dynamic = config.typed_value("dynamic_learning_rate")
        self._dynamic_checked = False
        self._warned_keys: set[str] = set()

    @property
    def needs_scores(self) -> bool:
        return self.kind != "constant"

    # ---- the lr of an epoch --------------------------------------------------------------

    def learning_rate_for_epoch(self, epoch: int) -> float:
        """The stored lr of ``epoch``; else computed now (predefined, else the scheme) and stored."""
        if epoch < 1:
            raise ValueError(f"epochs start at 1, got {epoch}")
        stored = self.scores.learning_rate(epoch)
        if stored is not None:
            return stored
        lr = self.calc_learning_rate_for_epoch(epoch)
        self.scores.set_learning_rate(epoch, lr)
        return lr

    def calc_learning_rate_for_epoch(self, epoch: int) -> float:
        """What ``learning_rate_for_epoch`` would store for ``epoch`` now (stores nothing)."""
        if epoch in self.predefined:
            return self.predefined[epoch]
        if self.min_num_epochs_per_new_lr > 1:
            last_lrs = [
                lr
                for e in self._epochs_before(epoch)[-self.min_num_epochs_per_new_lr :]
                if (lr := self._lr(e)) is not None
            ]
            if len(set(last_lrs)) >= 2 or 0 < len(last_lrs) < self.min_num_epochs_per_new_lr:
                return last_lrs[-1]  # the lr changed recently: keep it a while (RETURNN semantics)
        return getattr(self, f"_calc_{self.kind}")(epoch)

    def _calc_constant(self, epoch: int) -> float:
        return self.most_recent_learning_rate(epoch)

    def _calc_newbob_rel(self, epoch: int) -> float:
        return self._newbob(epoch, self.relative_error, self.relative_error_threshold)

    def _calc_newbob_abs(self, epoch: int) -> float:
        return self._newbob(epoch, self.absolute_error_change, self.error_threshold)

    def _newbob(self, epoch: int, change: Callable[[int, int], float | None], threshold: float) -> float:
        before = self._epochs_before(epoch)
        if not before:
            return self.default_learning_rate
        lr = self._lr(before[-1])
        if lr is None:
            return self.default_learning_rate
        if len(before) < 2:
            return lr
        delta = change(before[-2], before[-1])
        if delta is None:
            return lr
        return self._decay_or_grow(lr, decay=delta > threshold, grow=not delta > threshold)

    def _calc_newbob_multi_epoch(self, epoch: int) -> float:
        lr = self.most_recent_learning_rate(epoch)
        if self.multi_update_interval > 1 and epoch % self.multi_update_interval != 1:
            return lr  # epochs are counted from 1: checks happen at 1, 1+k, 1+2k, ...
        last = self._epochs_before(epoch)[-(self.multi_num_epochs + 1) :]
        if len(last) < 2:
            return lr
        changes = [self.relative_error(a, b) for a, b in zip(last[:-1], last[1:])]
        known = [c for c in changes if c is not None]
        if len(known) < len(changes):
            return lr
        mean = sum(known) / len(known)
        return self._decay_or_grow(
            lr, decay=mean > self.relative_error_threshold, grow=mean < self.relative_error_grow_threshold
        )

    def _decay_or_grow(self, lr: float, *, decay: bool, grow: bool) -> float:
        if decay:
            return max(_apply_factor(self.decay, lr, "learning_rate_decay"), self.min_learning_rate)
        if grow:
            return _apply_factor(self.growth, lr, "learning_rate_growth")
        return lr

    # ---- what the schemes read ------------------------------------------------------------

    def _lr(self, epoch: int) -> float | None:
        stored = self.scores.learning_rate(epoch)
        return stored if stored is not None else self.predefined.get(epoch)

    def _epochs_before(self, epoch: int) -> list[int]:
        """Epochs < ``epoch`` that have any data (a table row or a predefined lr), sorted."""
        return sorted(e for e in set(self.scores.epochs) | set(self.predefined) if e < epoch)

    def most_recent_learning_rate(self, epoch: int, *, exclude_current: bool = True) -> float:
        for e in reversed(self._epochs_before(epoch + (0 if exclude_current else 1))):
            lr = self._lr(e)
            if lr is not None:
                return lr
        return self.default_learning_rate

    def error_key(self, epoch: int) -> str | None:
        """The score key newbob compares for ``epoch`` (None when the epoch has no scores)."""
        scores = self.scores.scores(epoch)
        if not scores:
            return None
        if self.error_measure:
            measures = [self.error_measure] if isinstance(self.error_measure, str) else list(self.error_measure)
            for key in [k for m in measures for k in (m, m + "_output")]:
                if key in scores:
                    return key
            raise ConfigError(
                f"config key 'learning_rate_control_error_measure': {self.error_measure!r} is not among the "
                f"scores of epoch {epoch}: {', '.join(sorted(scores))}"
            )
        # RETURNN's order: dev_score, then the first dev_ key in sorted order (an error key too), then
        # train_score, then the smallest key
        candidates = (
            [k for k in ("dev_score", "dev_score_output") if k in scores]
            + sorted(k for k in scores if k.startswith("dev_score_output/"))
            + sorted(k for k in scores if k.startswith("dev_"))
            + [k for k in ("train_score", "train_score_output") if k in scores]
            + [min(scores)]
        )
        key = candidates[0]
        if self.needs_scores and key not in self._warned_keys:
            self._warned_keys.add(key)
            logger.warning(
                "learning_rate_control=%r: 'learning_rate_control_error_measure' is not set; using the score %r "
                "(set learning_rate_control_error_measure to choose another)",
                self.name,
                key,
            )
        return key

    def error_value(self, epoch: int) -> tuple[str | None, float | None]:
        key = self.error_key(epoch)
        return (None, None) if key is None else (key, self.scores.scores(epoch)[key])

    def relative_error(self, old_epoch: int, new_epoch: int) -> float | None:
        """``(new - old) / |new|`` (or ``/ |old|``), optionally divided by lr / initial lr."""
        old_key, old = self.error_value(old_epoch)
        new_key, new = self.error_value(new_epoch)
        if old is None or new is None or old_key != new_key:
            return None
        rel = _ratio(new - old, abs(old) if self.relative_error_div_by_old else abs(new))
        if self.relative_to_lr:
            lr = self.most_recent_learning_rate(new_epoch, exclude_current=False)
            if lr > 0 and self.default_learning_rate > 0:
                # a lower lr gives smaller improvements; judge them relative to that lr
                rel /= lr / self.default_learning_rate
        return rel

    def absolute_error_change(self, old_epoch: int, new_epoch: int) -> float | None:
        old_key, old = self.error_value(old_epoch)
        new_key, new = self.error_value(new_epoch)
        if old is None or new is None or old_key != new_key:
            return None
        return new - old

    # ---- per step ------------------------------------------------------------------------

    def dynamic_learning_rate(
        self, *, global_train_step: int, epoch: int, epoch_continuous: float | None, learning_rate: float
    ) -> float:
        """Config ``dynamic_learning_rate(*, global_train_step, epoch, epoch_continuous, learning_rate, **kw)``
        applied to the epoch's ``learning_rate``; the lr itself when unset. Pure Python."""
        fn = self._dynamic
        if fn is None:
            return learning_rate
        if not self._dynamic_checked:
            _check_dynamic_lr(fn)
            self._dynamic_checked = True
        lr = fn(
            global_train_step=global_train_step,
            epoch=epoch,
            epoch_continuous=epoch_continuous,
            learning_rate=learning_rate,
        )
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
            raise DynamicLearningRateError(
                f"config key 'dynamic_learning_rate' returned {type(lr).__name__} ({lr!r}); expected a Python float"
            )
        return float(lr)

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Nothing beyond the score table (which holds every lr); kept for a uniform API."""
        return {"learning_rate_control": self.kind}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("learning_rate_control")
        if saved is not None and saved != self.kind:
            logger.warning(
                "learning_rate_control changed from %r to %r since the checkpoint", saved, self.kind
            )

    def __repr__(self) -> str:
        return f"LearningRateControl({self.kind}, learning_rate={self.default_learning_rate})"


def check_error_measure(config: Config, datasets: Iterable[str]) -> None:
    """Before any work: each ``learning_rate_control_error_measure`` must name a score this run produces,
    ``<dataset>_loss_<loss>`` for one of ``datasets`` (the loss names are known only once a step ran:
    a wrong one is named at the first epoch end, after that epoch is saved)."""
    measure = config.typed_value("learning_rate_control_error_measure")
    if not measure or (config.typed_value("learning_rate_control") or "constant") == "constant":
        return
    names = sorted(datasets, key=len, reverse=True)  # "dev_other" before "dev"
    for m in [measure] if isinstance(measure, str) else list(measure):
        name = next((n for n in names if isinstance(m, str) and m.startswith(f"{n}_")), None)
        if name is None or not m.startswith(f"{name}_loss_") or m == f"{name}_loss_":
            raise ConfigError(
                f"config key 'learning_rate_control_error_measure': {m!r} is not a score this run produces; kit "
                f"names scores '<dataset>_loss_<loss name>' for the datasets {', '.join(map(repr, sorted(names)))} "
                "(e.g. 'dev_loss_ce' for a loss marked as 'ce')")


def make_lr_control(config: Config, scores: ScoreTable) -> LearningRateControl:
    """The LR control the config asks for (``learning_rate_control``)."""
    return LearningRateControl(config, scores)


def _ratio(num: float, den: float) -> float:
    if den == 0:
        return 0.0 if num == 0 else math.copysign(math.inf, num)
    return num / den


def _predefined_learning_rates(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if isinstance(value, (list, tuple)):
        return {i + 1: float(lr) for i, lr in enumerate(value)}
    if isinstance(value, dict):
        return {int(e): float(lr) for e, lr in value.items()}
    raise ConfigError(
        f"config key 'learning_rates': got {value!r}, expected a list (from epoch 1) or a dict epoch -> lr "
        "(strings are never evaluated)"
    )


def _factor_setting(config: Config, key: str, alias: str) -> float | Callable[[float], float]:
    """RETURNN: ``key`` if set, else its ``newbob_`` alias; a number or a function lr -> lr."""
    name = key if config.has(key) or not config.has(alias) else alias
    value = config.typed_value(name)
    if callable(value):
        return value
    number = config.float(name)
    if number is None:
        raise ConfigError(f"config key '{name}': got None, expected a number or a function lr -> lr")
    return number


def _apply_factor(update: float | Callable[[float], float], lr: float, key: str) -> float:
    if not callable(update):
        return lr * update
    new = update(lr)
    if isinstance(new, bool) or not isinstance(new, numbers.Real):
        raise ConfigError(f"config key '{key}': the function returned {new!r}, expected a float")
    return float(new)


def _check_dynamic_lr(fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise DynamicLearningRateError(f"config key 'dynamic_learning_rate': got {fn!r}, expected a callable")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        name = getattr(fn, "__qualname__", repr(fn))
        raise DynamicLearningRateError(
            f"config key 'dynamic_learning_rate': {name} must accept **kwargs "
            "(def dynamic_learning_rate(*, global_train_step, epoch, epoch_continuous, learning_rate, **kwargs)), "
            "so that kit can pass new arguments later"
        )
