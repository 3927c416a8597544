"""The debugger on the engine's bus (:class:`Debugger`) and what a hook receives (:class:`DebugContext`).

The debugger subscribes to the bus like every other view, with ``may_raise=True`` (a hook may stop
training): ``epoch_begin`` gives the hook a ``before_train_loop`` context, ``exception`` (user code
raised in train, eval or forward) and ``nonfinite`` (the guard fired, before the update) theirs;
a Session's break points build ``step`` contexts. The hook runs with every RNG state put back
afterwards, so looking never changes training. It lives here, beside the engine, because the CLI
and torchrun build contexts too; the hooks and the replay (:mod:`kit.debug`) act on contexts and
import this module, never the reverse.
"""

from __future__ import annotations

import contextlib
import html
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kit.data.batch import Batch
from kit.engine.accounting import StepLosses
from kit.engine.user_code import module_call_stack
from kit.events import Event, Events
from kit.rng import RngState

if TYPE_CHECKING:
    from kit.engine.progress import Progress

DEBUG_EVENTS = ("before_train_loop", "exception", "nonfinite", "step")

Hook = Callable[["DebugContext"], Any]


@dataclass
class DebugContext:
    """Everything about one debug event; :meth:`release` drops the tensors it holds.

    ``step`` is the step's 0-based index in its epoch, ``global_train_step`` the step
    user code saw as ``get_run_ctx().step``. ``rng_state`` is the torch (and CUDA) RNG
    state right before the step's user code ran; ``nonfinite`` names the losses and
    gradients the guard found non-finite.
    """

    event: str
    epoch: int
    step: int
    global_train_step: int
    stage: str = "train"
    batch: Batch | None = None  # a CPU copy, with seq tags
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    losses: dict[str, float] = field(default_factory=dict)
    exception: BaseException | None = None
    module_stack: list[str] = field(default_factory=list)
    rng_state: RngState | None = None
    nonfinite: list[str] = field(default_factory=list)
    # where :meth:`keep` puts the context: the Session's (or Engine's) ``last_failure``
    keeper: Callable[[DebugContext], None] | None = field(default=None, repr=False)

    @property
    def seq_tags(self) -> list[str]:
        return list(self.batch.seq_tags) if self.batch is not None else []

    def keep(self) -> None:
        """Keep this context as the owner's ``last_failure`` (what :func:`kit.debug.capture` does)."""
        if self.keeper is not None:
            self.keeper(self)

    def release(self) -> None:
        """Free the captured batch, and the exception whose frames may hold device tensors."""
        self.batch = self.model = self.optimizer = self.exception = self.rng_state = None

    def __str__(self) -> str:
        lines = [
            f"DebugContext: {self.event} during {self.stage} at epoch {self.epoch}, step {self.step} "
            f"(global step {self.global_train_step})"
        ]
        if self.losses:
            lines.append("losses: " + format_losses(self.losses))
        if self.nonfinite:
            lines.append("non-finite: " + ", ".join(self.nonfinite))
        if self.exception is not None and self.event != "nonfinite":  # that one only repeats the list above
            first_line = (str(self.exception).splitlines() or [""])[0]
            lines.append(f"exception: {type(self.exception).__name__}: {first_line}")
        if self.module_stack:
            lines.append("module call stack:\n" + "\n".join(f"  {m}" for m in self.module_stack))
        if self.batch is not None:
            lines.append(self.batch.summary())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def format_losses(losses: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in losses.items())


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put every global RNG state back after the block (hooks and replays never change training)."""
    saved = RngState.capture()
    try:
        yield
    finally:
        saved.restore()


class DebugSubject(Protocol):
    """What a debugger reads of the engine it watches: where training stands, the model and optimizer."""

    @property
    def progress(self) -> Progress: ...

    @property
    def model(self) -> torch.nn.Module | None: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...


class Debugger:
    """Builds DebugContexts from the bus' events and calls the current ``debug_hook``.

    It subscribes with ``may_raise=True``: a hook may raise to stop training, which a safely
    dispatched subscriber could not. ``keeper`` is where :meth:`DebugContext.keep` puts a context
    (held weakly: a context kept elsewhere never keeps its session alive).
    """

    def __init__(self, subject: DebugSubject, hook_getter: Callable[[], Hook | None],
                 keeper: Callable[[DebugContext], None] | None = None):
        self.subject = subject
        self.hook_getter = hook_getter
        self.keeper = _weak_callable(keeper) if keeper is not None else None

    def subscribe(self, events: Events) -> None:
        events.on(Event.EPOCH_BEGIN, self.on_epoch_begin, may_raise=True)
        events.on(Event.EXCEPTION, self.on_exception, may_raise=True)
        events.on(Event.NONFINITE, self.on_nonfinite, may_raise=True)

    def unsubscribe(self, events: Events) -> None:
        events.off(Event.EPOCH_BEGIN, self.on_epoch_begin)
        events.off(Event.EXCEPTION, self.on_exception)
        events.off(Event.NONFINITE, self.on_nonfinite)

    def on_epoch_begin(self, **_: Any) -> None:
        self.notify("before_train_loop")

    def on_exception(self, error: BaseException, stage: str, batch: Batch | None, rng: RngState | None,
                     **_: Any) -> None:
        self.notify("exception", error=error, stage=stage, batch=batch, rng=rng)

    def on_nonfinite(self, error: BaseException, batch: Batch, step_losses: StepLosses, rng: RngState | None,
                     **_: Any) -> None:
        self.notify("nonfinite", error=error, batch=batch, step_losses=step_losses, rng=rng)

    def notify(self, event: str, *, error: BaseException | None = None, batch: Batch | None = None,
               stage: str = "train", step_losses: StepLosses | None = None,
               rng: RngState | None = None) -> DebugContext | None:
        """Build the context and call the hook; nothing at all when no hook is set."""
        if self.hook_getter() is None:
            return None
        ctx = self.context(event, error=error, batch=batch, stage=stage, step_losses=step_losses, rng=rng)
        self.call_hook(ctx)
        return ctx

    def call_hook(self, ctx: DebugContext) -> None:
        hook = self.hook_getter()
        if hook is not None:
            with rng_kept():
                hook(ctx)

    def context(self, event: str, *, error: BaseException | None = None, batch: Batch | None = None,
                stage: str = "train", step_losses: StepLosses | None = None,
                rng: RngState | None = None) -> DebugContext:
        p = self.subject.progress
        step, global_step = p.step_in_epoch, p.global_train_step
        if event == "step":  # a break point, after the step: describe the step that just ran
            step, global_step = step - 1, global_step - 1
        model = self.subject.model
        return DebugContext(
            event=event,
            epoch=p.epoch,
            step=step,
            global_train_step=global_step,
            stage=stage.split(" ")[0],
            batch=cpu_copy(batch) if batch is not None else None,
            model=model,
            optimizer=self.subject.optimizer,
            losses=step_losses.normalized() if step_losses is not None else {},
            exception=error,
            module_stack=module_call_stack(error.__traceback__, model) if error is not None else [],
            rng_state=rng,
            nonfinite=list(getattr(error, "nonfinite", None) or []),
            keeper=self.keeper,
        )


def _weak_callable(fn: Callable[[DebugContext], None]) -> Callable[[DebugContext], None]:
    """``fn`` held weakly when it is a bound method (its object may be collected meanwhile)."""
    if not hasattr(fn, "__self__"):
        return fn
    ref = weakref.WeakMethod(fn)  # type: ignore[arg-type]

    def call(ctx: DebugContext) -> None:
        method = ref()
        if method is not None:
            method(ctx)

    return call


def cpu_copy(batch: Batch) -> Batch:
    """A CPU copy of ``batch`` (a context must not hold device memory, nor change when training goes on)."""
    fields = {k: f.cpu_copy() for k, f in batch.fields.items()}
    return Batch(
        fields, list(batch.seq_tags), list(batch.seq_idx), batch.epoch, batch.complete_frac, batch.batch_idx
    )
