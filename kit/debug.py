"""Debug hook instead of a debug shell: the failing step's context handed back as an object.

RETURNN's ``debug_shell_before_train_loop`` opens a blocking terminal shell (dead in
Jupyter) and its NaN check runs after the bad update. In kit the engine calls a hook
with a :class:`DebugContext` on these events, while the loop state is intact:

- ``before_train_loop`` — start of every train epoch
- ``exception`` — any exception from user code in train, eval or forward
- ``nonfinite`` — the non-finite guard fired, *before* the update (weights unchanged)
- ``step`` — ``session.break_on(step=..., when=...)`` matched

Hooks: :func:`capture` (default: keep it as ``session.last_failure``), :func:`post_mortem`
(pdb / IPython debugger in the failing frame), :func:`raise_` (re-raise), or any callable.
A hook runs with the RNG states put back afterwards, so looking never changes training.
:func:`replay` re-runs the captured step under a tracer that names the first operation,
module and source line that produced a NaN/Inf.

>>> session.debug_hook = kit.debug.capture      # doctest: +SKIP
>>> session.train()                              # doctest: +SKIP
NonFiniteLossError: non-finite values at epoch 1, step 5 ...
>>> session.last_failure.batch.seq_tags          # doctest: +SKIP
>>> session.replay()                             # doctest: +SKIP
first NaN/Inf: aten.div.Tensor in module scale (Scale), forward, from finite inputs ...
"""

from __future__ import annotations

import contextlib
import html
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kit.data.batch import Batch, Field
from kit.engine.user_code import module_call_stack
from kit.errors import KitError

DEBUG_EVENTS = ("before_train_loop", "exception", "nonfinite", "step")


class DebugStop(KitError):
    """Raised by :func:`raise_` for an event that carries no exception of its own."""

    def __init__(self, ctx: DebugContext):
        super().__init__(f"stopped by kit.debug.raise_ at {ctx.event} (epoch {ctx.epoch}, step {ctx.step})")
        self.context = ctx


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
    rng_state: Any = None
    nonfinite: list[str] = field(default_factory=list)
    owner: Any = field(default=None, repr=False)  # weak proxy to the Session (or Engine) it came from

    @property
    def seq_tags(self) -> list[str]:
        return list(self.batch.seq_tags) if self.batch is not None else []

    def release(self) -> None:
        """Free the captured batch, and the exception whose frames may hold device tensors."""
        self.batch = self.model = self.optimizer = self.exception = self.rng_state = None

    def __str__(self) -> str:
        lines = [
            f"DebugContext: {self.event} during {self.stage} at epoch {self.epoch}, step {self.step} "
            f"(global step {self.global_train_step})"
        ]
        if self.losses:
            lines.append("losses: " + _format_losses(self.losses))
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


def _format_losses(losses: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in losses.items())


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules["kit"])
)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith(_LIBRARY_DIRS):
        return False
    return not (filename.startswith(_STDLIB) and "-packages" not in filename)


# ---- built-in hooks ---------------------------------------------------------------------


def capture(ctx: DebugContext) -> None:
    """Default hook: keep failures (and break points) as ``session.last_failure``."""
    if ctx.event != "before_train_loop" and ctx.owner is not None:
        with contextlib.suppress(ReferenceError):
            ctx.owner.last_failure = ctx


def raise_(ctx: DebugContext) -> None:
    """Re-raise the event's exception (or :class:`DebugStop` when it has none)."""
    capture(ctx)
    if ctx.exception is not None:
        raise ctx.exception
    if ctx.event != "before_train_loop":
        raise DebugStop(ctx)


def post_mortem(ctx: DebugContext) -> None:
    """Open the debugger in the failing user code's frames (IPython's in a notebook, else pdb).

    Events without a raised exception (``nonfinite``, ``step``) have no failing frame:
    the context is printed instead; ``session.replay()`` finds the op.
    """
    capture(ctx)
    if ctx.event == "before_train_loop":
        return
    print(ctx)
    tb = ctx.exception.__traceback__ if ctx.exception is not None else None
    if tb is None:
        if ctx.event == "nonfinite":
            print("no failing frame to debug: call session.replay() to find the op that made the NaN/Inf")
        return
    try:
        from IPython.core.debugger import Pdb
    except ImportError:  # plain Python
        from pdb import Pdb
    below = _frames_below_user_code(tb)
    if below:
        print(f"(the debugger starts where the error was raised; `up` {below} times leads to your code)")
    debugger = Pdb()
    debugger.reset()
    debugger.interaction(None, tb)


def _frames_below_user_code(tb: Any) -> int:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    for i, filename in enumerate(reversed(frames)):
        if _is_user_file(filename):
            return i
    return 0


# ---- the engine-side subscriber -----------------------------------------------------------


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put every global RNG state back after the block (hooks and replays never change training)."""
    from kit.rng import restore, snapshot

    saved = snapshot()
    try:
        yield
    finally:
        restore(saved)


class Debugger:
    """Builds DebugContexts from engine notifications and calls the owner's ``debug_hook``.

    The engine calls :meth:`notify` directly (not through ``engine.events``): a hook may
    raise to stop training, which a safely dispatched event subscriber could not.
    """

    def __init__(self, engine: Any, owner: Any, hook_getter: Callable[[], Callable | None]):
        self.engine = engine
        self._owner = weakref.proxy(owner)
        self._hook_getter = hook_getter

    def notify(
        self,
        event: str,
        *,
        error: BaseException | None = None,
        batch: Any = None,
        stage: str = "train",
        step_losses: Any = None,
        rng: Any = None,
    ) -> DebugContext | None:
        """Build the context and call the hook; nothing at all when no hook is set."""
        if self._hook_getter() is None:
            return None
        ctx = self.context(event, error=error, batch=batch, stage=stage, step_losses=step_losses, rng=rng)
        self.call_hook(ctx)
        return ctx

    def call_hook(self, ctx: DebugContext) -> None:
        hook = self._hook_getter()
        if hook is not None:
            with rng_kept():
                hook(ctx)

    def context(
        self,
        event: str,
        *,
        error: BaseException | None = None,
        batch: Any = None,
        stage: str = "train",
        step_losses: Any = None,
        rng: Any = None,
    ) -> DebugContext:
        engine, p = self.engine, self.engine.progress
        step, global_step = p.step_in_epoch, p.global_train_step
        if event == "step":  # a break point, after the step: describe the step that just ran
            step, global_step = step - 1, global_step - 1
            rng = rng if rng is not None else getattr(engine, "_step_rng", None)
        model = engine.model
        return DebugContext(
            event=event,
            epoch=p.epoch,
            step=step,
            global_train_step=global_step,
            stage=stage.split(" ")[0],
            batch=_cpu_copy(batch) if batch is not None else None,
            model=model,
            optimizer=engine.updater.optimizer if engine.updater is not None else None,
            losses=step_losses.normalized() if step_losses is not None else {},
            exception=error,
            module_stack=module_call_stack(error.__traceback__, model) if error is not None else [],
            rng_state=rng,
            nonfinite=list(getattr(error, "nonfinite", None) or []),
            owner=self._owner,
        )


def _cpu_copy(batch: Batch) -> Batch:
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


def replay(engine: Any, ctx: DebugContext, *, anomaly: bool = True) -> Any:
    """Re-run exactly the captured step and name the first op/module/line that made a NaN/Inf.

    Returns a :class:`kit.debug_replay.ReplayReport`; see :mod:`kit.debug_replay`.
    """
    from kit.debug_replay import replay_step

    return replay_step(engine, ctx, anomaly=anomaly)


def __getattr__(name: str) -> Any:
    if name in ("ReplayReport", "Finding"):
        import kit.debug_replay

        return getattr(kit.debug_replay, name)
    raise AttributeError(f"module 'kit.debug' has no attribute {name!r}")
