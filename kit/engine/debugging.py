"""The engine's debug protocol: what it calls (:class:`DebugProtocol`) and what a hook receives (:class:`DebugContext`).

The engine calls ``debugger.notify(event, ...)`` at ``before_train_loop`` (start of every
train epoch), ``exception`` (user code raised in train, eval or forward) and ``nonfinite``
(the guard fired, before the update); a Session's break points build ``step`` contexts.
:class:`Debugger` is the implementation that builds a context and calls the ``debug_hook``
with every RNG state put back afterwards, so looking never changes training. It lives here,
beside the engine, because the engine builds contexts for the CLI and torchrun too; the hooks
and the replay (:mod:`kit.debug`) act on contexts and import this module, never the reverse.
"""

from __future__ import annotations

import contextlib
import html
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kit.data.batch import Batch, Field
from kit.engine.accounting import StepLosses
from kit.engine.user_code import module_call_stack

if TYPE_CHECKING:
    from kit.engine.engine import Engine

DEBUG_EVENTS = ("before_train_loop", "exception", "nonfinite", "step")

RngState = tuple[torch.Tensor, "list[torch.Tensor] | None"]  # torch's (and CUDA's) RNG state
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
    from kit.rng import restore, snapshot

    saved = snapshot()
    try:
        yield
    finally:
        restore(saved)


class DebugProtocol(Protocol):
    """What the engine calls at its debug events; a hook may raise to stop training."""

    def notify(
        self,
        event: str,
        *,
        error: BaseException | None = None,
        batch: Batch | None = None,
        stage: str = "train",
        step_losses: StepLosses | None = None,
        rng: RngState | None = None,
    ) -> object: ...


class Debugger:
    """Builds DebugContexts from engine notifications and calls the current ``debug_hook``.

    The engine calls :meth:`notify` directly (not through ``engine.events``): a hook may
    raise to stop training, which a safely dispatched event subscriber could not.
    ``keeper`` is where :meth:`DebugContext.keep` puts a context (held weakly: a context
    kept elsewhere never keeps its session alive).
    """

    def __init__(self, engine: Engine, hook_getter: Callable[[], Hook | None],
                 keeper: Callable[[DebugContext], None] | None = None):
        self.engine = engine
        self.hook_getter = hook_getter
        self.keeper = _weak_callable(keeper) if keeper is not None else None

    def notify(
        self,
        event: str,
        *,
        error: BaseException | None = None,
        batch: Batch | None = None,
        stage: str = "train",
        step_losses: StepLosses | None = None,
        rng: RngState | None = None,
    ) -> DebugContext | None:
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

    def context(
        self,
        event: str,
        *,
        error: BaseException | None = None,
        batch: Batch | None = None,
        stage: str = "train",
        step_losses: StepLosses | None = None,
        rng: RngState | None = None,
    ) -> DebugContext:
        engine, p = self.engine, self.engine.progress
        step, global_step = p.step_in_epoch, p.global_train_step
        if event == "step":  # a break point, after the step: describe the step that just ran
            step, global_step = step - 1, global_step - 1
            rng = rng if rng is not None else engine.step_rng_state
        model = engine.model
        return DebugContext(
            event=event,
            epoch=p.epoch,
            step=step,
            global_train_step=global_step,
            stage=stage.split(" ")[0],
            batch=cpu_copy(batch) if batch is not None else None,
            model=model,
            optimizer=engine.updater.optimizer if engine.updater is not None else None,
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
    fields = {
        k: Field(
            f.tensor.detach().to("cpu", copy=True),
            None if f.lengths is None else f.lengths.clone(),
            f.sparse_dim,
        )
        for k, f in batch.fields.items()
    }
    return Batch(
        fields, list(batch.seq_tags), list(batch.seq_idx), batch.epoch, batch.complete_frac, batch.batch_idx
    )
