"""Replay of a captured step: which operation, module and source line made the NaN/Inf?

A ``TorchDispatchMode`` checks every op's outputs while the captured step's forward and
backward run again (same batch, RNG and weights); a ``TorchFunctionMode`` stamps autograd
nodes with the module and line that created them, so a NaN that first appears in the
backward is traced to its forward origin. Used through :func:`kit.debug.replay` /
``session.replay()`` (see :mod:`kit.debug`).
"""

from __future__ import annotations

import contextlib
import html
import inspect
import linecache
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kit.config import Config
from kit.data.batch import Batch
from kit.debug.hooks import is_user_file
from kit.engine.accounting import stack_losses
from kit.engine.compute import Compute, total_loss
from kit.engine.debugging import DebugContext, format_losses, rng_kept
from kit.errors import KitError
from kit.run_ctx import RunCtx


class Replayable(Protocol):
    """What a replay reads of an engine: its config (the user's step functions) and its one forward/backward."""

    config: Config

    @property
    def compute(self) -> Compute | None: ...


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
            + (format_losses(self.losses) or "(none)")
            + (
                f" (captured: {format_losses(self.captured_losses)})"
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
    for leaf in _leaves(x):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.numel()
            and leaf.device.type != "meta"
            and not bool(torch.isfinite(leaf).all())
        ):
            return True
    return False


def _leaves(x: Any) -> Iterator[Any]:
    """The values inside nested tuples, lists and dicts (an op's inputs or outputs)."""
    if isinstance(x, (tuple, list)):
        for item in x:
            yield from _leaves(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _leaves(item)
    else:
        yield x


def _user_frame() -> tuple[str, int, str] | None:
    """The innermost frame outside torch, kit and the standard library: the user's line."""
    here = inspect.currentframe()
    frame: types.FrameType | None = here.f_back if here is not None else None
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
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
        if self.first is not None or _uninitialized(func) or not _nonfinite(out):
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


_ALLOCATORS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")


def _uninitialized(func: Any) -> bool:
    """Ops that return uninitialised memory (e.g. dropout's ``empty_like`` before ``bernoulli_``):
    whatever garbage they hold, NaN included, is not a finding."""
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", "") in _ALLOCATORS


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
        for leaf in _leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                origin = origin or self.tracer.origin()
                leaf.grad_fn.metadata.setdefault("kit_origin", origin)  # type: ignore[attr-defined]  # a dict
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


def _traced_backward(model: torch.nn.Module, total: torch.Tensor, tracer: _Tracer) -> list[str]:
    """Backward of ``total`` under the tracer; the parameters whose gradients are non-finite."""
    model.zero_grad(set_to_none=True)
    tracer.phase = "backward"
    with tracer.active():
        # the backward unscaled: a float16 loss scale only moves the range, and its
        # expected overflows (skipped by the scaler) would hide the op that made the NaN
        total.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and _nonfinite(p.grad)]
    return [f"gradient of {n}" for n in bad[:20]]


def replay_step(engine: Replayable, ctx: DebugContext, *, anomaly: bool = True) -> ReplayReport:
    """Re-run forward and backward of exactly the captured step; name the op that made a NaN/Inf.

    The step runs through the engine's own code (:mod:`kit.engine.compute`), as in training
    and eval. Same batch, same torch RNG state, same run context (epoch, step), same model; every op's
    outputs are checked, the first non-finite one is reported with its module and source
    line. ``anomaly=True`` also traces a NaN/Inf that first appears in the backward to the
    forward op, module and line that created it (as torch's anomaly mode does, without
    raising). Gradients, buffers, train/eval modes and RNG states are put back afterwards,
    so replaying never changes training. With gradient accumulation only the captured
    (last) micro-batch is replayed; for a ``step`` break the model is already updated.
    """
    if ctx is None or ctx.batch is None:
        raise KitError("nothing to replay: no captured batch (none was captured, or it was released)")
    compute = engine.compute
    if compute is None:
        raise KitError("nothing to replay on: the engine is not set up (no model)")
    model, train = compute.model, ctx.stage == "train"
    fn = engine.config.typed_value("forward_step" if ctx.stage == "forward" else "train_step")
    batch = ctx.batch.to(compute.device)
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
            ctx.rng_state.restore()
        model.train(train)
        try:
            with torch.set_grad_enabled(train):
                with tracer.active():
                    compute.forward(fn, run, batch)
                losses = stack_losses(run.losses).normalized()
                nonfinite = [f"loss {k}" for k, v in losses.items() if not math.isfinite(v)]
                if train and run.losses:
                    nonfinite += _traced_backward(model, total_loss(run), tracer)
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
