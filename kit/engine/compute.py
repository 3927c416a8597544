"""The one forward/backward: the user's step under its run context and autocast, its total loss, the backward.

Training (:meth:`Engine.train_step`), evaluation (:func:`kit.engine.evaluation.evaluate_dataset`)
and the debugger's replay (:func:`kit.debug.replay`) run these functions and nothing else, so a
change here (AMP, a new run-context feature) reaches all three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kit.data.batch import Batch
from kit.engine import amp
from kit.engine.user_code import annotate_exception
from kit.errors import KitError
from kit.run_ctx import RunCtx, run_ctx_scope

if TYPE_CHECKING:
    from kit.engine.debugging import RngState
    from kit.engine.engine import Engine

UserStep = Callable[..., Any]  # train_step / forward_step(*, model, extern_data, **kwargs)


def to_device(batch: Batch, device: torch.device) -> Batch:
    # the pipeline's batches are on the CPU: on a CPU device, .to() would only cost host time
    return batch if device.type == "cpu" else batch.to(device, non_blocking=True)


def forward(engine: Engine, fn: UserStep, ctx: RunCtx, batch: Batch) -> None:
    """``fn(model=, extern_data=)`` under the run context ``ctx`` (it collects the marked losses) and autocast;
    what ``fn`` returned is kept as ``ctx.returned`` (kit ignores it, but says so when no loss was marked)."""
    if engine.amp_dtype is None and engine.float_dtype is None:  # the usual step: no other context to enter
        ctx.run(fn, model=engine.model, extern_data=batch)
        return
    if engine.float_dtype is not None:  # RETURNN's default_float_dtype: float inputs in it, and torch's default
        batch = batch.with_float_dtype(engine.float_dtype)
    with run_ctx_scope(ctx), amp.autocast(engine.built_device, engine.amp_dtype), amp.default_dtype(engine.float_dtype):
        ctx.returned = fn(model=engine.model, extern_data=batch)


def run_user_step(engine: Engine, fn: UserStep, ctx: RunCtx, batch: Batch, *, stage: str) -> None:
    """:func:`forward`, with an exception from user code annotated, announced and shown to the debugger."""
    try:
        forward(engine, fn, ctx, batch)
    except Exception as exc:
        report_user_error(engine, exc, stage=stage, batch=batch, rng=engine.step_rng_state)
        raise


def report_user_error(engine: Engine, exc: Exception, *, stage: str, batch: Batch, rng: RngState | None) -> None:
    """Name the module call stack and the batch in ``exc``; emit ``exception``; notify the debugger."""
    annotate_exception(exc, stage=stage, model=engine.model, batch=batch)
    engine.events.emit("exception", error=exc, stage=stage, batch=batch)
    if engine.debugger is not None:
        engine.debugger.notify("exception", error=exc, stage=stage, batch=batch, rng=rng)


def total_loss(ctx: RunCtx) -> torch.Tensor:
    """The scaled sum of the marked losses that the backward runs on."""
    try:
        return ctx.total_loss()
    except KitError as exc:
        raise type(exc)(f"{exc} (config key 'train_step')") from None


def backward(total: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Backward of ``total``, scaled for float16; gradients of micro-batches are summed."""
    (scaler.scale(total) if scaler is not None else total).backward()
