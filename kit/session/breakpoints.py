"""Break points and failures of a :class:`kit.Session`: ``break_on``, ``last_failure``, ``replay``, ``release``.

A break point stops a train_* call after a matching step and returns the step's
:class:`~kit.debug.DebugContext` (also passed to the session's ``debug_hook`` as event
``"step"``); the next train_* call continues the same epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kit.debug.replay_step import Replayable
from kit.engine.debugging import DebugContext, Debugger, Hook
from kit.engine.step import StepResult
from kit.errors import SessionStateError

if TYPE_CHECKING:
    from kit.debug.replay_step import ReplayReport
    from kit.rng import RngState


class Breakable(Replayable, Protocol):
    """What break points need of an engine: a debugger to attach, the last step's batch and RNG, and
    what a replay reads (:class:`~kit.debug.replay_step.Replayable`)."""

    def attach_debugger(self, hook_getter: Callable[[], Hook | None],
                        keeper: Callable[[DebugContext], None] | None = None) -> Debugger: ...

    @property
    def last_batch(self) -> Any: ...

    @property
    def last_step_rng(self) -> RngState | None: ...


class Breakpoints:
    """Where to stop, the session's debugger, and the failure it kept last."""

    def __init__(self, engine: Breakable, hook_getter: Callable[[], Hook | None]):
        self.engine = engine
        self.step: int | None = None
        self.when: Callable[[StepResult], bool] | None = None
        self.last_failure: DebugContext | None = None
        self.debugger = engine.attach_debugger(hook_getter, self.keep)

    def keep(self, ctx: DebugContext) -> None:
        """Where :func:`kit.debug.capture` puts a context: ``session.last_failure``."""
        self.last_failure = ctx

    def set(self, step: int | None, when: Callable[[StepResult], bool] | None) -> None:
        self.step, self.when = step, when

    def matches(self, result: StepResult) -> bool:
        """Whether to stop after this step (a step break point matches once)."""
        if self.step is not None and result.global_train_step == self.step:
            self.step = None
            return True
        return self.when is not None and bool(self.when(result))

    def stop_here(self, result: StepResult) -> DebugContext:
        """The context of the step that just ran, shown to the hook (RNG states put back afterwards)."""
        ctx = self.debugger.context("step", batch=self.engine.last_batch, step_losses=result.step_losses,
                                    rng=self.engine.last_step_rng)
        self.debugger.call_hook(ctx)  # a hook never changes training
        self.last_failure = ctx
        return ctx

    def replay(self, ctx: DebugContext | None, *, anomaly: bool) -> ReplayReport:
        from kit import debug

        ctx = ctx if ctx is not None else self.last_failure
        if ctx is None:
            raise SessionStateError("nothing to replay: session.last_failure is empty (no failure captured)")
        return debug.replay(self.engine, ctx, anomaly=anomaly)

    def release(self) -> None:
        """Free the batch and device tensors held by the last captured failure."""
        if self.last_failure is not None:
            self.last_failure.release()
        self.last_failure = None
