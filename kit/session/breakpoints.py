"""Debugging calls of a :class:`kit.Session`: break points, replay, release (see :mod:`kit.debug`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kit.engine.engine import StepResult
from kit.errors import SessionStateError


class Debugging:
    """Mixin of :class:`kit.Session`: ``break_on``, ``replay``, ``release``."""

    def break_on(self, step: int | None = None, *, when: Callable[[StepResult], bool] | None = None) -> None:
        """Stop a train_* call after global step ``step`` (or after any step where ``when(result)``).

        The call returns the ``DebugContext`` (also passed to ``debug_hook`` as event
        ``"step"``); the next train_* call continues the same epoch. ``break_on()`` clears.
        """
        self._break_step, self._break_when = step, when

    def _break_matches(self, result: StepResult) -> bool:
        if self._break_step is not None and result.global_train_step == self._break_step:
            self._break_step = None
            return True
        return self._break_when is not None and bool(self._break_when(result))

    def _break_here(self, result: StepResult) -> Any:
        ctx = self.engine.debugger.context(
            "step", batch=self.engine.last_batch, step_losses=result.step_losses, rng=None
        )
        self.engine.debugger.call_hook(ctx)  # RNG states put back afterwards: a hook never changes training
        self.last_failure = ctx
        self.status = "paused"
        return ctx

    def replay(self, ctx: Any = None, *, anomaly: bool = True) -> Any:
        """Re-run exactly the captured step and report the first op/module producing NaN/Inf."""
        from kit import debug

        ctx = ctx if ctx is not None else self.last_failure
        if ctx is None:
            raise SessionStateError("nothing to replay: session.last_failure is empty (no failure captured)")
        with self._world():
            return debug.replay(self.engine, ctx, anomaly=anomaly)

    def release(self) -> None:
        """Free the batch and device tensors held by the last captured failure."""
        if self.last_failure is not None:
            self.last_failure.release()
        self.last_failure = None
