"""The engine's debug protocol, on the debug side: ``DebugContext`` and the ``Debugger`` that builds it.

The engine calls ``Debugger.notify`` on ``before_train_loop``, ``exception`` and ``nonfinite``;
a Session's break points build a ``step`` context. The hook runs with every RNG state put
back afterwards, so looking never changes training.
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

DEBUG_EVENTS = ("before_train_loop", "exception", "nonfinite", "step")


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


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules["kit"])
)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def is_user_file(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith(_LIBRARY_DIRS):
        return False
    return not (filename.startswith(_STDLIB) and "-packages" not in filename)


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
