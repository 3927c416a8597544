"""The run context of one step: where ``train_step`` marks losses and ``forward_step`` marks outputs.

>>> def train_step(*, model, extern_data, **_):
...     ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # per frame
...     kit.get_run_ctx().mark_as_loss(ce, "ce", mask=extern_data["data"].mask())
...     kit.get_run_ctx().mark_as_loss(frame_errors, "fer", as_error=True)

Semantics follow RETURNN's ``rf.RunCtx``: a loss is *summed* over its (masked) elements; it
carries an inverse norm factor (by default the number of summed elements). The reported
value of a step is ``sum / norm``; the reported value of an epoch is ``Σ sums / Σ norms``.
The gradient, however, comes from ``scale * sum`` — **not** the mean — unless
``use_normalized_loss=True``. Nothing in here moves a number from the device to the host.

The active context lives in a :class:`contextvars.ContextVar`, installed only for the
duration of a step by :func:`run_ctx_scope` (or ``ctx.activate()``); nesting restores the
outer one, and two engines (or sessions) never share a process-wide global.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from kit.errors import DataError, KitError

STAGES = ("train", "eval", "forward")
DEFAULT_OUTPUT_NAME = "output"

_active: contextvars.ContextVar[RunCtx | None] = contextvars.ContextVar("kit_run_ctx", default=None)


class NoRunCtxError(KitError, RuntimeError):
    """``get_run_ctx()`` was called outside of a step run by kit."""


class LossError(KitError, ValueError):
    """A loss was marked twice, or a training step marked no differentiable loss."""


@dataclass(eq=False)
class Loss:
    """One marked loss of a step; everything stays on the device.

    ``sum`` keeps the autograd graph (it is detached for ``as_error`` losses);
    ``inv_norm_factor`` is a 0-d tensor (the element count by default).
    """

    name: str
    sum: torch.Tensor
    inv_norm_factor: torch.Tensor
    scale: float = 1.0
    as_error: bool = False
    use_normalized_loss: bool = False

    def value_for_grad(self) -> torch.Tensor:
        """What enters ``total_loss()``: ``scale * sum`` (RETURNN's default) or ``scale * sum / norm``."""
        value = self.sum / self.inv_norm_factor if self.use_normalized_loss else self.sum
        return value * self.scale if self.scale != 1.0 else value

    def normalized(self) -> torch.Tensor:
        """The reported value of this step: ``sum / inv_norm_factor``, detached (unscaled)."""
        return self.sum.detach() / self.inv_norm_factor


@dataclass(eq=False)
class Output:
    """One marked forward output: the batched tensor and optionally the lengths of its dynamic axis."""

    name: str
    tensor: torch.Tensor
    lengths: torch.Tensor | None = None
    dims: Sequence[Any] | None = None


@dataclass(eq=False)
class RunCtx:
    """What one ``train_step`` / ``forward_step`` call marks.

    Args:
        stage: "train", "eval" or "forward".
        train_flag: whether the model runs in training mode (dropout on).
        epoch, step: the current epoch (1-based) and global train step.
        expected_outputs: config ``model_outputs``: name -> {"shape": (...), "dim": n} or a list of
            names; ``mark_as_output`` and :meth:`check_outputs` compare against it.
    """

    stage: str
    train_flag: bool = field(kw_only=True)
    epoch: int = field(kw_only=True)
    step: int = field(kw_only=True)
    expected_outputs: Mapping[str, Any] | Sequence[str] | None = field(default=None, kw_only=True)
    losses: dict[str, Loss] = field(default_factory=dict, init=False)
    outputs: dict[str, Output] = field(default_factory=dict, init=False)
    # what the user's step function returned: kit ignores it, but names it when no loss was marked
    returned: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"RunCtx stage must be one of {STAGES}, got {self.stage!r}")
        if self.expected_outputs is not None and not isinstance(self.expected_outputs, Mapping):
            if isinstance(self.expected_outputs, str):
                raise DataError(
                    f"model_outputs: got {self.expected_outputs!r}, expected a dict or list of names"
                )
            self.expected_outputs = {name: {} for name in self.expected_outputs}

    def __repr__(self) -> str:  # never prints tensor values (that would copy them to the host)
        return (
            f"RunCtx({self.stage!r}, train_flag={self.train_flag}, epoch={self.epoch}, step={self.step}, "
            f"losses={list(self.losses)}, outputs={list(self.outputs)})"
        )

    # ---- activation -------------------------------------------------------------------

    def activate(self) -> contextlib.AbstractContextManager[RunCtx]:
        """Install this context for the duration of a ``with`` block (see :func:`run_ctx_scope`)."""
        return run_ctx_scope(self)

    def run(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        """``fn(**kwargs)`` with this context installed (the engine's call of a step function: one
        Python call per step where a ``with`` block takes three); kept as ``returned`` and returned."""
        token = _active.set(self)
        try:
            self.returned = fn(**kwargs)
        finally:
            _active.reset(token)
        return self.returned

    # ---- losses -----------------------------------------------------------------------

    def mark_as_loss(
        self,
        loss: torch.Tensor,
        name: str,
        *,
        scale: float = 1.0,
        as_error: bool = False,
        use_normalized_loss: bool = False,
        custom_inv_norm_factor: torch.Tensor | float | None = None,
        mask: torch.Tensor | None = None,
    ) -> Loss:
        """Mark ``loss`` (any shape, e.g. per frame) as a loss named ``name``.

        The loss is **summed** over all its elements (only where ``mask`` is True, when given;
        ``mask`` is a bool tensor broadcastable to the loss' shape). Its inverse norm factor is
        the number of summed elements, or ``custom_inv_norm_factor`` (summed) when given.
        Reported: ``sum / norm`` per step, ``Σ sum / Σ norm`` per epoch.

        **The gradient comes from ``scale * sum`` — the sum, not the mean (RETURNN's default),
        so its size grows with the batch.** Pass ``use_normalized_loss=True`` to differentiate
        ``scale * sum / norm`` instead. ``as_error=True`` losses (e.g. frame error rate) are
        reported only and never differentiated.

        No device→host sync happens here (no ``.item()``, no branching on tensor values).

        Raises:
            LossError: when ``name`` was already marked in this step.
        """
        if name in self.losses:
            raise LossError(
                f"mark_as_loss: the loss name {name!r} was already marked in this step; each name only once "
                f"(marked so far: {', '.join(self.losses)})"
            )
        if not isinstance(loss, torch.Tensor):
            loss = torch.as_tensor(loss, dtype=torch.get_default_dtype())
        if loss.dtype in (torch.float16, torch.bfloat16) or not loss.is_floating_point():
            loss = loss.float()  # half-precision sums overflow; bool/int error counts become floats
        if mask is not None:
            # the usual mask (a bool tensor of the loss' shape on its device) passes one line of checks
            if (type(mask) is not torch.Tensor or mask.dtype is not torch.bool or mask.shape != loss.shape
                    or mask.device != loss.device):
                mask = _check_mask(mask, loss, name)
            loss_sum = torch.where(mask, loss, 0).sum()  # where, not *: NaN in padding must not leak
        else:
            loss_sum = loss.sum()
        if custom_inv_norm_factor is not None:
            norm = _as_norm_tensor(custom_inv_norm_factor, loss.device)
        elif mask is not None:
            norm = (mask if mask.shape == loss.shape else torch.broadcast_to(mask, loss.shape)).sum()
        else:
            norm = torch.full((), loss.numel(), dtype=torch.int64, device=loss.device)
        if as_error:
            loss_sum = loss_sum.detach()
        entry = Loss(
            name=name,
            sum=loss_sum,
            inv_norm_factor=norm,
            scale=float(scale),
            as_error=bool(as_error),
            use_normalized_loss=bool(use_normalized_loss),
        )
        self.losses[name] = entry
        return entry

    def total_loss(self) -> torch.Tensor:
        """Sum of ``value_for_grad()`` over the non-error losses: what ``backward()`` runs on.

        Raises:
            LossError: in training, when no differentiable loss was marked.
        """
        parts = [loss.value_for_grad() for loss in self.losses.values() if not loss.as_error]
        if not parts:
            if self.train_flag or self.stage == "train":
                raise LossError(self._no_loss_message())
            device = next(iter(self.losses.values())).sum.device if self.losses else None
            return torch.zeros((), device=device)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def _no_loss_message(self) -> str:
        if self.losses:
            return (f"train_step marked only error losses (as_error=True): {', '.join(self.losses)}; "
                    "mark at least one differentiable loss with mark_as_loss(...)")
        message = ('train_step marked no loss: mark at least one differentiable loss with '
                   'kit.get_run_ctx().mark_as_loss(loss, "ce") inside train_step (per frame with '
                   "reduction='none', or a scalar)")
        if isinstance(self.returned, torch.Tensor):
            message += ("; it returned a tensor instead, but kit ignores return values (unlike Lightning): "
                        'replace `return loss` by kit.get_run_ctx().mark_as_loss(loss, "loss")')
        return message

    # ---- outputs ----------------------------------------------------------------------

    def mark_as_output(
        self,
        tensor: torch.Tensor,
        name: str,
        *,
        lengths: torch.Tensor | None = None,
        dims: Sequence[Any] | None = None,
    ) -> Output:
        """Mark a batched forward output (batch first); ``lengths`` gives its dynamic axis' lengths."""
        if name in self.outputs:
            raise DataError(f"mark_as_output: the output name {name!r} was already marked in this step")
        if not isinstance(tensor, torch.Tensor):
            raise DataError(f"mark_as_output({name!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if self.expected_outputs is not None:
            if name not in self.expected_outputs:
                raise DataError(
                    f"mark_as_output: output {name!r} is not declared in model_outputs "
                    f"(declared: {', '.join(self.expected_outputs) or '(none)'})"
                )
            problem = _shape_problem(name, tensor, cast(Mapping[str, Any], self.expected_outputs)[name])
            if problem:
                raise DataError(problem)
        out = Output(name=name, tensor=tensor, lengths=lengths, dims=dims)
        self.outputs[name] = out
        return out

    def mark_as_default_output(self, tensor: torch.Tensor, *, lengths: torch.Tensor | None = None) -> Output:
        """``mark_as_output(tensor, "output")``."""
        return self.mark_as_output(tensor, DEFAULT_OUTPUT_NAME, lengths=lengths)

    def check_outputs(self) -> None:
        """Compare the marked outputs with ``expected_outputs``; one error naming every problem."""
        if not self.outputs and self.stage == "forward":
            hint = " (kit ignores return values)" if self.returned is not None else ""
            raise DataError(
                "forward_step marked no output" + hint + ': call kit.get_run_ctx().mark_as_output(tensor, "name") '
                'inside forward_step, e.g. mark_as_output(logits, "logits", lengths=extern_data["data"].lengths)'
            )
        if self.expected_outputs is None:
            return
        problems = []
        missing = [n for n in self.expected_outputs if n not in self.outputs]
        unexpected = [n for n in self.outputs if n not in self.expected_outputs]
        if missing:
            problems.append(f"missing outputs (declared in model_outputs, not marked): {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected outputs (marked, not in model_outputs): {', '.join(unexpected)}")
        for name, out in self.outputs.items():
            if name in self.expected_outputs:
                problem = _shape_problem(name, out.tensor, cast(Mapping[str, Any], self.expected_outputs)[name])
                if problem:
                    problems.append(problem)
        if problems:
            raise DataError("forward_step outputs do not match model_outputs: " + "; ".join(problems))


def _check_mask(mask: torch.Tensor, loss: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise DataError(f"mark_as_loss({name!r}): mask must be a bool tensor, got {got}")
    try:  # torch.broadcast_shapes is Python (~30 µs): skip it in the common equal-shape case
        shape = loss.shape if mask.shape == loss.shape else torch.broadcast_shapes(mask.shape, loss.shape)
    except RuntimeError:
        shape = None
    if shape != loss.shape:
        raise DataError(
            f"mark_as_loss({name!r}): mask of shape {tuple(mask.shape)} does not broadcast to the loss "
            f"shape {tuple(loss.shape)}"
        )
    return mask.to(loss.device) if mask.device != loss.device else mask


def _as_norm_tensor(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().sum()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"custom_inv_norm_factor must be a tensor or a number, got {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        return torch.full((), int(value), dtype=torch.int64, device=device)
    # torch.full: a fill kernel with a scalar argument; no host→device copy that could sync
    return torch.full((), float(value), device=device)


def _shape_problem(name: str, tensor: torch.Tensor, spec: Any) -> str | None:
    """RETURNN's model_outputs: ``shape`` excludes the batch axis; ``dim`` is the last axis."""
    if not isinstance(spec, Mapping):
        return None
    shape = spec.get("shape")
    if shape is not None:
        expected = (None, *shape)
        if tensor.dim() != len(expected) or any(
            e is not None and e != g for e, g in zip(expected, tensor.shape)
        ):
            return f"output {name!r}: shape {tuple(tensor.shape)} does not match model_outputs shape (B, {', '.join(map(str, shape))})"
    dim = spec.get("dim")
    if dim is not None and not spec.get("sparse") and (tensor.dim() == 0 or tensor.shape[-1] != dim):
        return f"output {name!r}: last axis {tuple(tensor.shape)[-1:]} does not match model_outputs dim {dim}"
    return None


# ---- the active context -------------------------------------------------------------------


class run_ctx_scope:  # noqa: N801 - used like the function it was: ``with run_ctx_scope(ctx):``
    """Make ``ctx`` what :func:`get_run_ctx` returns inside the block; restores the previous one.

    A class, not a generator: it is entered on every step, and a generator-based context
    manager costs several Python calls more each time.
    """

    __slots__ = ("ctx", "_token")

    def __init__(self, ctx: RunCtx):
        self.ctx = ctx
        self._token: contextvars.Token | None = None

    def __enter__(self) -> RunCtx:
        self._token = _active.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _active.reset(self._token)
        self._token = None


def get_run_ctx() -> RunCtx:
    """The run context of the step that is running now.

    Raises:
        NoRunCtxError (a RuntimeError): outside of a step run by kit.
    """
    ctx = _active.get()
    if ctx is None:
        raise NoRunCtxError(
            "get_run_ctx() is only available inside train_step/forward_step run by kit "
            "(to try one by hand: `with kit.run_ctx.run_ctx_scope(RunCtx('train', train_flag=True, epoch=1, step=0)):`)"
        )
    return ctx


def current_run_ctx() -> RunCtx | None:
    """The active run context, or None (no error)."""
    return _active.get()


def mark_as_loss(loss: torch.Tensor, name: str, **kwargs: Any) -> Loss:
    """Shorthand for ``get_run_ctx().mark_as_loss(...)``."""
    return get_run_ctx().mark_as_loss(loss, name, **kwargs)


def mark_as_output(tensor: torch.Tensor, name: str, **kwargs: Any) -> Output:
    """Shorthand for ``get_run_ctx().mark_as_output(...)``."""
    return get_run_ctx().mark_as_output(tensor, name, **kwargs)


def mark_as_default_output(tensor: torch.Tensor, **kwargs: Any) -> Output:
    """Shorthand for ``get_run_ctx().mark_as_default_output(...)``."""
    return get_run_ctx().mark_as_default_output(tensor, **kwargs)
