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
import linecache
import math
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
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


# ---- replay: where did the NaN/Inf come from? ----------------------------------------------


@dataclass
class Finding:
    """An operation whose output was non-finite.

    In the backward pass ``op`` is the backward kernel, ``grad_fn`` the autograd node it
    ran for, and ``module`` / ``location`` say where that node was created in the forward.
    """

    op: str
    phase: str  # "forward" or "backward"
    module: str | None  # dotted path in the model; "" is the model itself; None: outside any module
    module_type: str
    location: str
    inputs_finite: bool
    grad_fn: str = ""

    def __str__(self) -> str:
        where = (
            "outside the model's modules"
            if self.module is None
            else f"module {self.module or '(the model itself)'} ({self.module_type})"
        )
        if self.phase == "backward" and self.location == _NO_FRAME:
            return (
                f"{self.op} in the backward of {self.grad_fn or 'an autograd node'} "
                "(replay with anomaly=True to trace it to the forward line)"
            )
        if self.phase == "backward":
            head = f"{self.op} in the backward of {self.grad_fn or 'an autograd node'}, created in {where}"
        else:
            head = f"{self.op} in {where}, forward"
        origin = "from finite inputs" if self.inputs_finite else "(its inputs were already non-finite)"
        return f"{head}, {origin}\n  at {self.location}"


@dataclass
class ReplayReport:
    """What :func:`replay` found; ``op``, ``module`` and ``location`` are those of the first finding."""

    event: str
    where: str
    first: Finding | None  # first op producing NaN/Inf from finite inputs
    first_any: Finding | None  # first op with any non-finite output
    losses: dict[str, float]
    nonfinite: list[str]  # non-finite losses and gradients of the replay
    bad_inputs: list[str]  # batch fields or parameters that were non-finite before the step
    error: str | None  # what the replayed step raised, if anything
    captured_losses: dict[str, float] = field(default_factory=dict)
    captured_nonfinite: list[str] = field(default_factory=list)
    captured_error: str | None = None  # type name of the captured exception

    @property
    def found(self) -> bool:
        return self.first is not None or self.first_any is not None

    @property
    def finding(self) -> Finding | None:
        return self.first or self.first_any

    @property
    def op(self) -> str | None:
        return self.finding.op if self.finding else None

    @property
    def module(self) -> str | None:
        return self.finding.module if self.finding else None

    @property
    def location(self) -> str | None:
        return self.finding.location if self.finding else None

    @property
    def reproduced(self) -> bool:
        """The replay shows what was captured: same exception type, or same losses (NaN equal
        NaN) and the same non-finite losses and gradients."""
        if self.captured_error is not None and self.captured_error != "NonFiniteLossError":
            return self.error is not None and self.error.split(":")[0] == self.captured_error
        if self.error is not None or not self.captured_losses:
            return False
        same_losses = self.captured_losses.keys() == self.losses.keys() and all(
            _same(self.losses[k], v) for k, v in self.captured_losses.items()
        )
        return same_losses and _same_nonfinite(self.captured_nonfinite, self.nonfinite)

    def __str__(self) -> str:
        status = "reproduced" if self.reproduced else "NOT reproduced (see below)"
        lines = [
            f"replay of the {self.event} step {self.where}: {status}",
            "  losses: "
            + (_format_losses(self.losses) or "(none)")
            + (
                f" (captured: {_format_losses(self.captured_losses)})"
                if not self.reproduced and self.captured_losses
                else ""
            ),
        ]
        if self.nonfinite:
            lines.append("  non-finite: " + ", ".join(self.nonfinite))
        if self.bad_inputs:
            lines.append("  already non-finite before the step: " + ", ".join(self.bad_inputs))
        if self.first is not None:
            lines.append(f"first NaN/Inf: {self.first}")
        elif self.first_any is not None:
            lines.append(f"first op with a NaN/Inf output: {self.first_any}")
        else:
            lines.append("no operation produced a NaN/Inf")
        if self.error:
            lines.append(f"the replayed step raised {self.error}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def _format_losses(losses: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in losses.items())


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=1e-6)  # same kernels; GPU reductions may reorder


def _same_nonfinite(captured: list[str], replayed: list[str]) -> bool:
    cap = {x for x in captured if not x.startswith("gradient norm")}
    rep = set(replayed)
    cap_grads = {x for x in cap if x.startswith("gradient of")}
    rep_grads = {x for x in rep if x.startswith("gradient of")}
    if cap - cap_grads != rep - rep_grads or bool(cap_grads) != bool(rep_grads):
        return False
    # clipping by a NaN global norm spreads NaN to every gradient, and the engine names at most 20
    return rep_grads <= cap_grads or len(cap_grads) >= 20


def _nonfinite(x: Any) -> bool:
    for leaf in tree_leaves(x):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.numel()
            and leaf.device.type != "meta"
            and not bool(torch.isfinite(leaf).all())
        ):
            return True
    return False


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules["kit"])
)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith(_LIBRARY_DIRS):
        return False
    return not (filename.startswith(_STDLIB) and "-packages" not in filename)


def _user_frame() -> tuple[str, int, str] | None:
    """The innermost frame outside torch, kit and the standard library: the user's line."""
    frame = sys._getframe(1)
    while frame is not None:
        if _is_user_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


_NO_FRAME = "(no user code on the stack)"


def _format_frame(frame: tuple[str, int, str] | None) -> str:
    if frame is None:
        return _NO_FRAME
    filename, lineno, name = frame
    return f"{filename}:{lineno} in {name}: {linecache.getline(filename, lineno).strip()}"


class _Tracer:
    """Checks every op's outputs for NaN/Inf (a dispatch mode) and, in the forward, stamps each
    autograd node with the module and line that created it (a function mode), so that a
    NaN first appearing in the backward is traced back to its forward origin."""

    def __init__(self, stack: list[tuple[str, str]], stamp: bool):
        self.stack = stack  # (path, type) of the modules whose forward is running
        self.stamp = stamp
        self.phase = "forward"
        self.first: Finding | None = None
        self.first_any: Finding | None = None
        self._last_origin: tuple[Any, str] = (None, "")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.stamp and self.phase == "forward":
                stack.enter_context(_Stamper(self))
            stack.enter_context(_Checker(self))
            yield

    def origin(self) -> tuple[str | None, str, tuple[str, int, str] | None]:
        return (*self.stack[-1], _user_frame()) if self.stack else (None, "", _user_frame())

    def check(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if self.first is not None or not _nonfinite(out):
            return
        inputs_finite = not _nonfinite((args, kwargs))
        if self.first_any is not None and not inputs_finite:
            return
        grad_fn = ""
        if self.phase == "forward":
            module, module_type, frame = self.origin()
        else:
            (module, module_type, frame), grad_fn = self._backward_origin()
        finding = Finding(
            str(func), self.phase, module, module_type, _format_frame(frame), inputs_finite, grad_fn
        )
        if inputs_finite:
            self.first = finding
        if self.first_any is None:
            self.first_any = finding

    def _backward_origin(self) -> tuple[tuple[Any, str, Any], str]:
        node = _current_autograd_node()
        stamped = node.metadata.get("kit_origin") if node is not None else None
        # a node made inside a composite op (e.g. cross_entropy) carries no stamp; its consumer ran just before
        origin = stamped or self._last_origin[0] or (None, "", None)
        return origin, type(node).__name__ if node is not None else self._last_origin[1]

    def note_backward_node(self) -> None:
        node = _current_autograd_node()
        if node is not None and "kit_origin" in node.metadata:
            self._last_origin = (node.metadata["kit_origin"], type(node).__name__)


def _current_autograd_node() -> Any:
    get = getattr(torch._C, "_current_autograd_node", None)  # private: absent in some torch versions
    return get() if get is not None else None


class _Checker(TorchDispatchMode):
    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.tracer.phase == "backward":
            self.tracer.note_backward_node()
        self.tracer.check(func, args, kwargs, out)
        return out


class _Stamper(TorchFunctionMode):
    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        origin = None
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                origin = origin or self.tracer.origin()
                leaf.grad_fn.metadata.setdefault("kit_origin", origin)
        return out


def _module_hooks(model: torch.nn.Module, stack: list[tuple[str, str]]) -> list[Any]:
    """Keep ``stack`` = the (path, type) of the modules whose forward is running."""

    def enter(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            stack.append((path, type(module).__name__))

        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


@contextlib.contextmanager
def _model_state_kept(model: torch.nn.Module) -> Iterator[None]:
    """Gradients, buffers (e.g. BatchNorm statistics) and train/eval modes are put back afterwards."""
    grads = {p: p.grad for p in model.parameters()}  # the replay sets new grad tensors; these stay intact
    buffers = {b: b.detach().clone() for b in model.buffers()}
    modes = {m: m.training for m in model.modules()}
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers.items():
                b.copy_(saved)
        for m, training in modes.items():
            m.training = training


def _bad_inputs(batch: Batch, model: torch.nn.Module) -> list[str]:
    bad = [f"batch field {k!r}" for k, f in batch.fields.items() if _nonfinite(f.tensor)]
    return bad + [f"parameter {n}" for n, p in model.named_parameters() if _nonfinite(p)][:20]


def replay(engine: Any, ctx: DebugContext, *, anomaly: bool = True) -> ReplayReport:
    """Re-run forward and backward of exactly the captured step; name the op that made a NaN/Inf.

    Same batch, same torch RNG state, same run context (epoch, step), same model; every op's
    outputs are checked, the first non-finite one is reported with its module and source
    line. ``anomaly=True`` also traces a NaN/Inf that first appears in the backward to the
    forward op, module and line that created it (as torch's anomaly mode does, without
    raising). Gradients, buffers, train/eval modes and RNG states are put back afterwards,
    so replaying never changes training. With gradient accumulation only the captured
    (last) micro-batch is replayed; for a ``step`` break the model is already updated.
    """
    if ctx is None or ctx.batch is None:
        raise KitError("nothing to replay: no captured batch (none was captured, or it was released)")
    from kit.engine import amp
    from kit.engine.accounting import stack_losses
    from kit.run_ctx import RunCtx, run_ctx_scope

    model, train = engine.model, ctx.stage == "train"
    fn = engine.config.typed_value("forward_step" if ctx.stage == "forward" else "train_step")
    batch = ctx.batch.to(engine.device)
    stack: list[tuple[str, str]] = []
    tracer = _Tracer(stack, stamp=anomaly and train)
    run = RunCtx(
        ctx.stage if ctx.stage in ("eval", "forward") else "train",
        train_flag=train,
        epoch=ctx.epoch,
        step=ctx.global_train_step if train else batch.batch_idx,
    )
    losses: dict[str, float] = {}
    nonfinite: list[str] = []
    error = None
    bad_inputs = _bad_inputs(batch, model)
    handles = _module_hooks(model, stack)
    with _model_state_kept(model), rng_kept():
        if ctx.rng_state is not None:
            torch.set_rng_state(ctx.rng_state[0])
            if ctx.rng_state[1] is not None:
                torch.cuda.set_rng_state_all(ctx.rng_state[1])
        model.train(train)
        try:
            with torch.set_grad_enabled(train), run_ctx_scope(run):
                with tracer.active(), amp.autocast(engine.device, engine.amp_dtype):
                    fn(model=model, extern_data=batch)
                losses = stack_losses(run.losses).normalized()
                nonfinite = [f"loss {k}" for k, v in losses.items() if not math.isfinite(v)]
                if train and run.losses:
                    total = run.total_loss()
                    model.zero_grad(set_to_none=True)
                    tracer.phase = "backward"
                    with tracer.active():
                        total.backward()
                    nonfinite += [
                        f"gradient of {n}"
                        for n, p in model.named_parameters()
                        if p.grad is not None and _nonfinite(p.grad)
                    ][:20]
        except Exception as exc:  # the report says what the step raised instead of raising it
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        finally:
            for h in handles:
                h.remove()
    captured_error = type(ctx.exception).__name__ if ctx.exception is not None else None
    where = f"(epoch {ctx.epoch}, step {ctx.step}, global step {ctx.global_train_step})"
    return ReplayReport(
        ctx.event,
        where,
        tracer.first,
        tracer.first_any,
        losses,
        nonfinite,
        bad_inputs,
        error,
        dict(ctx.losses),
        [x for x in ctx.nonfinite if not x.startswith("gradient norm")],
        captured_error,
    )
