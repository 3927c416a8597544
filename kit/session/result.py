"""``TrainResult``: what every ``train_*`` call of a Session returns, however it ended.

One type for all of them: the call's ``outcome`` says whether it reached its goal (``"done"``),
found every epoch trained (``"finished"``), stopped at a step boundary on an interrupt or Pause
(``"paused"``) or at a break point (``"break"``); the step result, the epoch's scores and the
break point's :class:`~kit.debug.DebugContext` are inside. ``result["dev_loss_ce"]`` reads the
last finished epoch's score row, as the row itself did when ``train_epoch()`` returned it.
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kit.engine.debugging import DebugContext
    from kit.engine.step import StepResult

Outcome = Literal["done", "finished", "paused", "break"]


@dataclass(frozen=True, eq=False)
class TrainResult(Mapping[str, Any]):
    """How a train call ended, where training stands, and what it produced.

    ``epoch`` / ``step`` / ``global_train_step``: after ``train_step()`` / ``train_steps(n)`` that did
    their steps, the position of the last step (as ``last_step`` has it, and as their result always
    said); otherwise (an epoch or a run done, paused, a break point, finished) where the next step
    starts. ``last_step``: the last
    step's :class:`~kit.StepResult` (None when the call ran none). ``scores``: the score row of the last
    epoch that finished (during this call or before). ``debug``: the break point's context. ``reason``:
    why it paused. ``goal`` / ``steps_left`` / ``mode``: what the call was doing and how it ran.
    """

    outcome: Outcome
    epoch: int
    step: int
    global_train_step: int
    last_step: StepResult | None = None
    scores: dict[str, Any] = field(default_factory=dict)
    scores_epoch: int | None = None  # the epoch ``scores`` belong to
    debug: DebugContext | None = None
    reason: str = ""
    goal: str = "train"  # "train", "epoch" or "steps"
    steps_left: int = 0  # goal "steps", paused: how many of its steps it had still to do
    mode: str = "blocking"  # "blocking" (train_*), "awaitable" (train_*_async) or "background"

    @property
    def paused(self) -> bool:
        return self.outcome == "paused"

    @property
    def finished(self) -> bool:
        """Every epoch is trained (``extend`` or ``train(num_epochs=...)`` adds more)."""
        return self.outcome == "finished"

    @property
    def losses(self) -> dict[str, float]:
        """The last step's normalized losses ({} when the call ran no step)."""
        return self.last_step.losses if self.last_step is not None else {}

    # the score row, as a mapping (what train_epoch() returned before it returned a TrainResult)
    def __getitem__(self, key: str) -> Any:
        try:
            return self.scores[key]
        except KeyError:
            if not self.scores:
                raise KeyError(f"{key!r}: no epoch has finished yet, so there are no scores") from None
            raise KeyError(f"{key!r} is not a score of epoch {self.scores_epoch} "
                           f"(its scores: {', '.join(self.scores)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.scores)

    def __len__(self) -> int:
        return len(self.scores)

    def __bool__(self) -> bool:  # a result is never "empty", whatever its score row holds
        return True

    def summary(self) -> str:
        """One line: how the call ended and where training stands."""
        where = f"epoch {self.epoch}, step {self.step} (global step {self.global_train_step})"
        if self.outcome == "paused":
            return f"paused at epoch {self.epoch}, step {self.step} ({self.reason}) — call train_epoch() or train() to continue"
        if self.outcome == "break":
            return f"stopped at a break point after global step {self.global_train_step - 1}; next: {where}"
        if self.outcome == "finished" and self.last_step is not None:
            return (f"finished: trained to the final epoch {self.epoch - 1} — extend(n) or "
                    "train(num_epochs=...) trains more")
        if self.outcome == "finished":
            return (f"finished: all {self.epoch - 1} epochs are trained, nothing left to train — "
                    "extend(n) or train(num_epochs=...) trains more")
        if self.goal == "steps":
            return f"done: the last step was {where}"
        return f"done: next is {where}"

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.last_step is not None:
            lines.append("last step: " + _format(self.losses))
        if self.scores:
            lines.append(f"epoch {self.scores_epoch} scores: " + _format(self.scores))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TrainResult({self.summary()})"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{_number(v)}</td></tr>" for k, v in self.scores.items())
        head = f"<tr><th>epoch {self.scores_epoch}</th><th></th></tr>"
        table = f"<table>{head}{rows}</table>" if rows else ""
        step = f"<br>last step: {html.escape(_format(self.losses))}" if self.last_step is not None else ""
        return f"<b>{html.escape(self.summary())}</b>{step}{table}"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def _format(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {_number(v)}" for k, v in values.items()) or "(none)"
