"""``Compute``: the one forward/backward — the user's step under its run context and autocast, its loss, the backward.

Training (:mod:`kit.engine.step`), evaluation (:mod:`kit.engine.evaluation`), forward
(:mod:`kit.engine.forward`) and the debugger's replay (:func:`kit.debug.replay`) run through one
``Compute`` and nothing else, so a change here (AMP, a new run-context feature) reaches all four.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kit.data.batch import Batch
from kit.engine import amp
from kit.engine.user_code import annotate_exception
from kit.errors import KitError
from kit.events import Events, ExceptionRaised
from kit.run_ctx import RunCtx, run_ctx_scope

if TYPE_CHECKING:
    from kit.rng import RngState

UserStep = Callable[..., Any]  # train_step / forward_step(*, model, extern_data, **kwargs)


class Compute:
    """The model on its device with the step's float settings; runs user steps and backwards."""

    def __init__(self, model: torch.nn.Module, device: torch.device, events: Events, *,
                 amp_dtype: torch.dtype | None = None, float_dtype: torch.dtype | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None):
        self.model, self.device, self.events = model, device, events
        self.amp_dtype, self.float_dtype, self.grad_scaler = amp_dtype, float_dtype, grad_scaler

    def to_device(self, batch: Batch) -> Batch:
        # the pipeline's batches are on the CPU: on a CPU device, .to() would only cost host time. On CUDA the
        # prefetch thread pinned them (PipelineOptions.pin_memory), so the copy runs beside the host's work
        return batch if self.device.type == "cpu" else batch.to(self.device, non_blocking=True)

    def forward(self, fn: UserStep, ctx: RunCtx, batch: Batch) -> None:
        """``fn(model=, extern_data=)`` under the run context ``ctx`` (it collects the marked losses) and
        autocast; what ``fn`` returned is kept as ``ctx.returned`` (kit says so when no loss was marked)."""
        if self.amp_dtype is None and self.float_dtype is None:  # the usual step: no other context to enter
            ctx.run(fn, model=self.model, extern_data=batch)
            return
        if self.float_dtype is not None:  # RETURNN's default_float_dtype: float inputs in it, and torch's default
            batch = batch.with_float_dtype(self.float_dtype)
        with run_ctx_scope(ctx), amp.autocast(self.device, self.amp_dtype), amp.default_dtype(self.float_dtype):
            ctx.returned = fn(model=self.model, extern_data=batch)

    def run_user_step(self, fn: UserStep, ctx: RunCtx, batch: Batch, *, stage: str,
                      rng: RngState | None = None) -> None:
        """:meth:`forward`, with an exception from user code annotated and announced (``exception``)."""
        try:
            self.forward(fn, ctx, batch)
        except Exception as exc:
            self.report_user_error(exc, stage=stage, batch=batch, rng=rng)
            raise

    def report_user_error(self, exc: Exception, *, stage: str, batch: Batch, rng: RngState | None) -> None:
        """Name the module call stack and the batch in ``exc``; emit ``exception`` (the debugger listens)."""
        annotate_exception(exc, stage=stage, model=self.model, batch=batch)
        self.events.emit(ExceptionRaised(exc, stage, batch, rng))

    def backward(self, ctx: RunCtx) -> None:
        """Backward of the marked losses' scaled sum, scaled for float16; gradients of micro-batches add up."""
        total = total_loss(ctx)
        (self.grad_scaler.scale(total) if self.grad_scaler is not None else total).backward()


def total_loss(ctx: RunCtx) -> torch.Tensor:
    """The scaled sum of the marked losses that the backward runs on."""
    try:
        return ctx.total_loss()
    except KitError as exc:
        raise type(exc)(f"{exc} (config key 'train_step')") from None
