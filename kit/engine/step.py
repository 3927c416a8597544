"""One train step, as an algorithm box: what it reads (``StepOptions``), what it does (:func:`train_step`)
and what it returns (``StepResult``).

The step fetches, runs the user's forward and losses, the backward, the finite check, the update
and the accounting — and nothing else: no logging, no files, no events of its own (the loop around
it, :class:`kit.engine.engine.Engine`, schedules log lines, checkpoints, evals and LR probes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kit.config import Config
from kit.engine.accounting import StepLosses, grad_norm_name, stack_losses
from kit.engine.schedule import Schedule
from kit.rng import RngState
from kit.run_ctx import RunCtx

if TYPE_CHECKING:
    from kit.data.batch import Batch
    from kit.engine.parts import Built, Training
    from kit.engine.progress import Progress


@dataclass
class StepResult:
    """What one train step did. Loss values are read from the device only when asked.

    ``step`` is the step's 0-based index in its epoch and ``global_train_step`` its
    0-based global index (the ``step`` user code sees in the run context).
    """

    epoch: int
    step: int
    global_train_step: int
    learning_rate: float
    updated: bool
    seconds: float
    num_seqs: int
    complete_frac: float | None
    step_losses: StepLosses
    grad_norm: torch.Tensor | None = None  # before norm clipping, when gradient_clip_global_norm is set
    memory_peak: int | None = None  # bytes: the step's CUDA peak (None on other devices)

    @property
    def losses(self) -> dict[str, float]:
        """Normalized loss per name (sum / norm; with ``:exp`` scores under ``calculate_exp_loss``) — one
        device→host read, cached."""
        return self.step_losses.reported()

    def __repr__(self) -> str:
        losses = ", ".join(f"{k} {v:.4g}" for k, v in self.losses.items())
        return f"StepResult(ep {self.epoch}, step {self.step}, global {self.global_train_step}: {losses})"


@dataclass(frozen=True)
class StepOptions:
    """The config values a train step and its loop read, read once per config version (not per step)."""

    train_step: Callable[..., Any]
    accum_grad_multiple_step: Any  # int or callable
    dynamic_learning_rate: Callable[..., float] | None
    log_every: int
    save_every: int  # 0: no step checkpoints
    accum_fixed: int | None = None  # micro-batches per update when the config gives a number (not a function)
    keep_rng: bool = False  # keep torch's RNG before each step's user code (a debugger may replay the step)
    exp_loss: bool = False  # calculate_exp_loss: reported losses add <name>:exp
    log_grad_norm: float | None = None  # log_grad_norm: p of the gradient norm scored on update steps

    @classmethod
    def read(cls, config: Config, *, keep_rng: bool = False, reloader: Any = None) -> StepOptions:
        """``reloader``: a :class:`kit.engine.hot_reload.ConfigReloader` (``use_hot_reloading``) wraps the step."""
        accum = config.typed_value("accum_grad_multiple_step")
        if reloader is not None:
            from kit.engine.hot_reload import hot_step

            fn = hot_step(config, "train_step", reloader)
        else:
            fn = config.typed_value("train_step")
        return cls(
            train_step=fn,
            accum_grad_multiple_step=accum,
            dynamic_learning_rate=config.typed_value("dynamic_learning_rate"),
            log_every=1 if config.int("log_verbosity") >= 4 else config.int("log_every_n_steps"),
            save_every=(config.int("save_every_n_steps") or 0) if config.typed_value("model") else 0,
            accum_fixed=None if callable(accum) else max(1, int(accum)),
            keep_rng=keep_rng,
            exp_loss=config.bool("calculate_exp_loss"),
            log_grad_norm=parse_log_grad_norm(config.typed_value("log_grad_norm")),
        )


def parse_log_grad_norm(value: Any) -> float | None:
    """RETURNN's ``log_grad_norm``: True is p=2, a number is p, False / None / "false" / "none" is off."""
    if isinstance(value, str):
        value = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    if value is None or value is False:
        return None
    if value is True:
        return 2
    return value  # checked by the config registry: a number > 0


def train_step(batch: Batch, started: float, p: Progress, b: Built, t: Training, opts: StepOptions) -> StepResult:
    """Train on ``batch``, the next micro-batch of the running epoch, which the loop took from the pipeline
    at ``started`` (``time.perf_counter()``: the step's seconds include its data)."""
    # fetch: the batch to the device
    t.last_batch, device_batch = batch, b.compute.to_device(batch)
    # window: a new accumulation window starts without gradients; this step's learning rate
    if p.accum_count == 0:
        t.updater.zero_grad()
    lr = t.schedule.for_step(p, opts.dynamic_learning_rate)
    window = opts.accum_fixed or Schedule.accum_window(opts.accum_grad_multiple_step, p, batch)
    # forward and losses: the user's train_step marks them under its run context (DDP: through its forward)
    t.step_rng = RngState.capture(host=False) if opts.keep_rng else None  # for a replay of this step
    fn = opts.train_step if b.dist is None else b.dist.train_step(
        opts.train_step, sync=p.accum_count + 1 >= window or batch.complete_frac == 1)
    ctx = RunCtx("train", train_flag=True, epoch=p.epoch, step=p.global_train_step)
    b.compute.run_user_step(fn, ctx, device_batch, stage="train", rng=t.step_rng)
    losses = stack_losses(ctx.losses)
    losses.exp = opts.exp_loss
    # backward: scaled for float16; the window's micro-batches add up their gradients
    b.compute.backward(ctx)
    p.micro_batch_added()
    # finite check: the losses and the window's gradients, before any update (a bad one raises or is skipped)
    finite = t.guard.check(losses, p, batch, t.step_rng)
    # update: when the window is complete
    updated = finite and p.accum_count >= window
    grad_norm, logged_norm = update(p, b, t, opts.log_grad_norm) if updated else (None, None)
    if logged_norm is not None:  # RETURNN's grad_norm:p2 score: once per update (norm 1), pre-clip
        losses = losses.with_score(grad_norm_name(opts.log_grad_norm or 2), logged_norm)
    # account: the losses stay on the device
    t.accounting.add(losses)
    result = StepResult(p.epoch, p.step_in_epoch, p.global_train_step, lr, updated, time.perf_counter() - started,
                        batch.num_seqs, batch.complete_frac, losses, grad_norm, b.memory.end_step())
    p.step_done(batch.complete_frac)
    return result


def update(p: Progress, b: Built, t: Training,
           log_grad_norm: float | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Unscale (float16) → gradient noise → clip → optimizer step; the window closes. Returns the gradient
    norm before clipping when norm clipping is set, and the ``log_grad_norm``-norm of the gradients after
    unscaling, before noise and clipping, when asked (device tensors, never read here)."""
    scaler, optimizer = b.compute.grad_scaler, t.updater.optimizer
    if scaler is not None:
        scaler.unscale_(optimizer)
    logged = None
    if log_grad_norm is not None and not (log_grad_norm == 2 and t.updater.clip_returns_raw_norm):
        grads = [prm.grad for prm in b.model.parameters() if prm.grad is not None]  # RETURNN: the module's order
        logged = torch.nn.utils.get_total_norm(grads, norm_type=log_grad_norm)
    t.updater.apply_gradient_noise()
    grad_norm = t.updater.clip_gradients()
    if log_grad_norm is not None and logged is None:
        logged = grad_norm
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        t.updater.optimizer_step()  # torch_optimizer_step: compiled / captured
    p.update_done()
    if b.dist is not None:  # reduce_type "param": the weights are averaged every param_sync_step updates
        b.dist.after_update(b.model, p.num_updates)
    return grad_norm, logged
