"""An epoch's frame: how it starts (learning rate, seeds, data plan) and ends (scores, eval, LR
control, score file, checkpoint), and the per-step schedule inside it (the step's learning rate
from ``dynamic_learning_rate``, the accumulation window from ``accum_grad_multiple_step``).

:class:`~kit.engine.engine.Engine` calls these at its unit boundaries; the loop
(:mod:`kit.engine.loop`) and every driver reach them only through ``train_step`` and
``finish_epoch``.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kit.data.batch import Batch
from kit.engine.accounting import EpochAccounting
from kit.engine.guard import check_learning_rate
from kit.engine.step import StepOptions
from kit.engine.user_code import call_user
from kit.errors import DataError
from kit.rng import epoch_seed, seed_all

if TYPE_CHECKING:
    from kit.engine.engine import Engine

logger = logging.getLogger("kit")


def begin_epoch(engine: Engine) -> None:
    """The epoch's learning rate, seeds and data plan; ``epoch_begin``."""
    p = engine.progress
    engine.epoch_learning_rate = lr = float(engine.built_lr_control.learning_rate_for_epoch(p.epoch))
    check_learning_rate(lr, "the learning rate control (learning_rate, learning_rates, learning_rate_file)",
                        f"epoch {p.epoch}")
    engine.built_updater.set_learning_rate(lr)
    engine.step_learning_rate = lr
    # randomness depends on (random_seed, epoch, global step) only, not on process history
    # (and on the rank: DDP ranks must not all draw the same dropout masks)
    dist = engine.dist
    rank = (dist.rank,) if dist and dist.rank else ()  # rank 0 draws as one process
    seed_all(epoch_seed(p.epoch, p.global_train_step, engine.config.int("random_seed"), *rank))  # RETURNN's
    engine.built_pipeline.set_epoch(p.epoch)
    engine.accounting = EpochAccounting()
    p.epoch_running, p.steps_exhausted, p.step_in_epoch = True, False, 0
    p.skipped_updates_in_epoch, p.epoch_start_global_step = 0, p.global_train_step
    p.last_complete_frac = 0.0
    engine.epoch_start_time = time.time()
    engine.built_model.train()
    logger.info("start epoch %d, global train step %d, learning rate %g", p.epoch, p.global_train_step, lr)
    engine.events.emit("epoch_begin", epoch=p.epoch, learning_rate=lr)
    if engine.debugger is not None:
        engine.debugger.notify("before_train_loop", batch=None)


def end_epoch(engine: Engine) -> dict[str, Any]:
    """After the epoch's last step: train scores, eval, next LR, score file, checkpoint; ``epoch_end``."""
    p, table = engine.progress, engine.built_scores
    epoch = p.epoch
    if engine.accounting.num_steps == 0:
        raise DataError(f"epoch {epoch}: the training dataset gave no batches")
    table.set_scores(epoch, engine.accounting.scores("train_loss_"), errors=engine.accounting.error_keys("train_loss_"))
    table.set_meta(epoch, **epoch_meta(engine))
    engine.record_eval(epoch, engine.eval_model())
    p.epoch, p.epoch_running, p.steps_exhausted, p.step_in_epoch = epoch + 1, False, False, 0
    if p.epoch <= engine.final_epoch:  # newbob decides with this epoch's scores; stored when epoch e+1 starts,
        # so the score file holds exactly one row per finished epoch (as RETURNN's after a crash)
        logger.info("learning rate for epoch %d: %g", p.epoch,
                    engine.built_lr_control.calc_learning_rate_for_epoch(p.epoch))
    engine.save_scores()
    if engine.model_prefix and (epoch % engine.config.int("save_interval") == 0 or epoch >= engine.final_epoch):
        engine.save_checkpoint(kind="epoch", epoch=epoch)
    row = engine.epoch_scores(epoch)
    logger.info("finished epoch %d: %s", epoch, format_scores(table.scores(epoch)))
    engine.events.emit("epoch_end", epoch=epoch, scores=row)
    return row


def epoch_meta(engine: Engine) -> dict[str, Any]:
    """The run metadata of the epoch that just ended (the score file's meta columns)."""
    import kit

    p = engine.progress
    return {
        # RETURNN's meaning: the global step at the epoch's start; its end under global_train_step_end
        "global_train_step": p.epoch_start_global_step,
        "global_train_step_end": p.global_train_step,
        "effective_learning_rate": engine.step_learning_rate,
        "epoch_num_train_steps": engine.accounting.num_steps,
        "epoch_train_time_secs": round(time.time() - engine.epoch_start_time, 3),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hostname": platform.node(),
        "device": str(engine.device),
        "torch_version": torch.__version__,
        "kit_version": kit.__version__,
        "skipped_updates": p.skipped_updates_in_epoch,
        "peak_memory_bytes": engine.built_memory.peak_bytes(),
    }


def format_scores(scores: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in scores.items()) or "(no scores)"


# ---- inside the epoch: the step's schedule ----------------------------------------------


def set_step_learning_rate(engine: Engine, opts: StepOptions) -> float:
    """The learning rate of the step about to run: the epoch's, or ``dynamic_learning_rate``'s."""
    p, lr = engine.progress, engine.epoch_learning_rate
    if opts.dynamic_learning_rate is not None:
        # RETURNN sets the lr before a step from the position after the previous one
        # (epoch - 1 at the first step of an epoch), not from the batch about to be trained
        lr = engine.built_lr_control.dynamic_learning_rate(
            global_train_step=p.global_train_step, epoch=p.epoch,
            epoch_continuous=p.epoch - 1 + p.last_complete_frac, learning_rate=engine.epoch_learning_rate)
        check_learning_rate(lr, "config key 'dynamic_learning_rate'", f"global step {p.global_train_step}")
    if lr != engine.step_learning_rate:
        engine.built_updater.set_learning_rate(lr)
        engine.step_learning_rate = lr
    return lr


def accum_grad_multiple_step(engine: Engine, batch: Batch, opts: StepOptions) -> int:
    """Micro-batches per update window (``accum_grad_multiple_step``, a number or a function)."""
    value = opts.accum_grad_multiple_step
    if callable(value):
        p = engine.progress
        frac = batch.complete_frac if batch.complete_frac is not None else 0.0
        value = call_user(value, "accum_grad_multiple_step", epoch=p.epoch, epoch_continuous=p.epoch - 1 + frac,
                          global_train_step=p.global_train_step)
    return max(1, int(value))
