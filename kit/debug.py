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
:func:`replay` re-runs the captured step under a tracer that names the first operation
and module that produced a NaN/Inf.
"""

from __future__ import annotations

import html
import math
import os
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
    """Everything about one debug event; ``release()`` drops the tensors it holds."""

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
    rng_state: Any = None  # torch (and CUDA) RNG states before the step
    nonfinite: list[str] = field(default_factory=list)
    owner: Any = None  # weak proxy to the Session (or Engine) it came from

    @property
    def seq_tags(self) -> list[str]:
        return list(self.batch.seq_tags) if self.batch is not None else []

    def release(self) -> None:
        """Free the captured batch and references to device tensors."""
        self.batch = self.model = self.optimizer = self.exception = self.rng_state = None

    def __str__(self) -> str:
        lines = [f"DebugContext: {self.event} during {self.stage} at epoch {self.epoch}, step {self.step} "
                 f"(global step {self.global_train_step})"]
        if self.losses:
            lines.append("losses: " + ", ".join(f"{k} {v:.4g}" for k, v in self.losses.items()))
        if self.nonfinite:
            lines.append("non-finite: " + ", ".join(self.nonfinite))
        if self.exception is not None:
            lines.append(f"exception: {type(self.exception).__name__}: {str(self.exception).splitlines()[0]}")
        if self.module_stack:
            lines.append("module call stack:\n" + "\n".join(f"  {m}" for m in self.module_stack))
        if self.batch is not None:
            lines.append(self.batch.summary())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


# ---- built-in hooks ---------------------------------------------------------------------


def capture(ctx: DebugContext) -> None:
    """Default hook: keep failures (and break points) as ``session.last_failure``."""
    if ctx.event != "before_train_loop" and ctx.owner is not None:
        try:
            ctx.owner.last_failure = ctx
        except ReferenceError:
            pass


def raise_(ctx: DebugContext) -> None:
    """Re-raise the event's exception (or :class:`DebugStop` when it has none)."""
    capture(ctx)
    if ctx.exception is not None:
        raise ctx.exception
    if ctx.event != "before_train_loop":
        raise DebugStop(ctx)


def post_mortem(ctx: DebugContext) -> None:
    """Open the debugger in the failing user code's frame (works in a notebook cell)."""
    capture(ctx)
    if ctx.exception is None or ctx.exception.__traceback__ is None:
        print(ctx)
        return
    try:
        from IPython.core.debugger import Pdb
    except ImportError:  # plain Python
        from pdb import Pdb
    print(ctx)
    debugger = Pdb()
    debugger.reset()
    debugger.interaction(None, ctx.exception.__traceback__)


# ---- the engine-side subscriber -----------------------------------------------------------


class Debugger:
    """Builds DebugContexts from engine notifications and calls the owner's ``debug_hook``."""

    def __init__(self, engine: Any, owner: Any, hook_getter: Callable[[], Callable | None]):
        self.engine = engine
        self._owner = weakref.proxy(owner)
        self._hook_getter = hook_getter

    def notify(self, event: str, *, error: BaseException | None = None, batch: Any = None, stage: str = "train",
               step_losses: Any = None, rng: Any = None, result: Any = None) -> DebugContext | None:
        hook = self._hook_getter()
        if hook is None:
            return None
        ctx = self.context(event, error=error, batch=batch, stage=stage, step_losses=step_losses, rng=rng)
        hook(ctx)
        return ctx

    def context(self, event: str, *, error: BaseException | None = None, batch: Any = None, stage: str = "train",
                step_losses: Any = None, rng: Any = None) -> DebugContext:
        engine, p = self.engine, self.engine.progress
        losses = step_losses.normalized() if step_losses is not None else {}
        model = engine.model
        return DebugContext(
            event=event, epoch=p.epoch, step=p.step_in_epoch, global_train_step=p.global_train_step,
            stage=stage.split(" ")[0], batch=_cpu_copy(batch) if batch is not None else None, model=model,
            optimizer=engine.updater.optimizer if engine.updater is not None else None, losses=losses,
            exception=error,
            module_stack=module_call_stack(error.__traceback__, model) if error is not None else [],
            rng_state=rng, nonfinite=list(getattr(error, "nonfinite", []) or []), owner=self._owner)


def _cpu_copy(batch: Batch) -> Batch:
    fields = {k: Field(f.tensor.detach().to("cpu", copy=True), f.lengths, f.sparse_dim) for k, f in batch.fields.items()}
    return Batch(fields, list(batch.seq_tags), list(batch.seq_idx), batch.epoch, batch.complete_frac, batch.batch_idx)


# ---- replay ------------------------------------------------------------------------------


@dataclass
class Finding:
    """An operation whose output was non-finite."""

    op: str
    module: str
    location: str
    phase: str  # "forward" or "backward"
    inputs_finite: bool

    def __str__(self) -> str:
        origin = "from finite inputs" if self.inputs_finite else "(inputs already non-finite)"
        return f"{self.op} in module {self.module or '(outside any module)'} during {self.phase} {origin}\n  at {self.location}"


@dataclass
class ReplayReport:
    """What :func:`replay` found: the first op/module producing NaN/Inf, and the losses it saw."""

    event: str
    first: Finding | None
    first_any: Finding | None
    losses: dict[str, float]
    captured_losses: dict[str, float]
    error: str | None = None

    @property
    def found(self) -> bool:
        return self.first is not None or self.first_any is not None

    @property
    def reproduced(self) -> bool:
        """The replayed losses equal the captured ones (NaN equals NaN)."""
        return bool(self.captured_losses) and all(
            _same(self.losses.get(k), v) for k, v in self.captured_losses.items())

    @property
    def op(self) -> str | None:
        return (self.first or self.first_any).op if self.found else None

    @property
    def module(self) -> str | None:
        return (self.first or self.first_any).module if self.found else None

    @property
    def location(self) -> str | None:
        return (self.first or self.first_any).location if self.found else None

    def __str__(self) -> str:
        lines = [f"replay of the {self.event} step: losses " +
                 (", ".join(f"{k} {v:.4g}" for k, v in self.losses.items()) or "(none)") +
                 (" — same as captured" if self.reproduced else "")]
        if self.first is not None:
            lines.append(f"first non-finite value produced by {self.first}")
        elif self.first_any is not None:
            lines.append(f"first op with a non-finite output: {self.first_any}")
        else:
            lines.append("no operation produced a NaN/Inf")
        if self.error:
            lines.append(f"replay raised: {self.error}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def _same(a: float | None, b: float) -> bool:
    if a is None:
        return False
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _has_nonfinite(tree: Any) -> bool:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.device.type != "meta" and leaf.numel():
            if not bool(torch.isfinite(leaf).all()):
                return True
    return False


_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


def _user_location() -> str:
    """The innermost stack frame outside torch and kit: where the user's code called the op."""
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(_SKIP_DIRS) and "contextlib" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line or ''}".strip()
    return "(unknown)"


class _NonFiniteTracer(TorchDispatchMode):
    """Checks every op's outputs; records the first producing NaN/Inf from finite inputs."""

    def __init__(self, module_stack: list[str]):
        super().__init__()
        self.module_stack = module_stack
        self.phase = "forward"
        self.first: Finding | None = None
        self.first_any: Finding | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.first is None and _has_nonfinite(out):
            inputs_finite = not _has_nonfinite((args, kwargs))
            finding = Finding(str(func), self.module_stack[-1] if self.module_stack else "",
                              _user_location(), self.phase, inputs_finite)
            if inputs_finite:
                self.first = finding
            elif self.first_any is None:
                self.first_any = finding
        return out


def _module_hooks(model: torch.nn.Module, stack: list[str]) -> list[Any]:
    """Keep ``stack`` = the modules whose forward is running, as ``(Type) path`` strings."""

    def enter(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            stack.append(path)

        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(f"({type(module).__name__}) {name or '(root)'}")))
        handles.append(module.register_forward_hook(leave))
    return handles


def replay(engine: Any, ctx: DebugContext, *, anomaly: bool = True) -> ReplayReport:
    """Re-run forward and backward of exactly the captured step and trace NaN/Inf to its op.

    Same batch, same torch RNG state, same model; gradients, RNG and train/eval mode are
    put back afterwards, so replaying never changes training.
    """
    if ctx is None or ctx.batch is None:
        raise KitError("nothing to replay: no captured failure (or it was released)")
    from kit.engine.accounting import stack_losses
    from kit.rng import restore, snapshot
    from kit.run_ctx import RunCtx, run_ctx_scope

    model = engine.model
    fn = engine.config.typed_value("forward_step" if ctx.stage == "forward" else "train_step")
    saved_rng, was_training = snapshot(), model.training
    saved_grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    if ctx.rng_state is not None:
        torch.set_rng_state(ctx.rng_state[0])
        if ctx.rng_state[1] is not None:
            torch.cuda.set_rng_state_all(ctx.rng_state[1])
    model.train(ctx.stage == "train")
    stack: list[str] = []
    handles = _module_hooks(model, stack)
    tracer = _NonFiniteTracer(stack)
    run = RunCtx(ctx.stage if ctx.stage in ("train", "eval", "forward") else "train",
                 train_flag=ctx.stage == "train", epoch=ctx.epoch, step=ctx.global_train_step)
    error, losses = None, {}
    try:
        with warnings.catch_warnings(), tracer, torch.autograd.set_detect_anomaly(anomaly, check_nan=anomaly), \
                run_ctx_scope(run):
            warnings.simplefilter("ignore")  # anomaly mode prints the forward trace; the report says it shorter
            fn(model=model, extern_data=ctx.batch.to(engine.device))
            losses = stack_losses(run.losses).normalized()
            if ctx.stage == "train" and run.losses:
                model.zero_grad(set_to_none=True)
                tracer.phase = "backward"
                run.total_loss().backward()
    except Exception as exc:  # the replay reports what the step raised instead of raising it
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.grad = saved_grads[n]
        model.train(was_training)
        restore(saved_rng)
    return ReplayReport(ctx.event, tracer.first, tracer.first_any, losses, dict(ctx.losses), error)

