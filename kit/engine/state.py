"""What a checkpoint holds besides the weights (the training state), and the engine's saves and cleanup.

:func:`train_state` / :func:`load_train_state` are everything a bit-exact continuation needs:
progress, optimizer, scaler, LR control, learning rates, data position, the epoch's loss
sums, an open accumulation window's gradients and the RNG states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kit import checkpoints
from kit.errors import ConfigError
from kit.rng import get_rng_state, set_rng_state

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.engine.engine import Engine


def train_state(engine: Engine) -> dict[str, Any]:
    """Everything besides the weights that a bit-exact continuation needs."""
    p = engine.progress
    updater = engine.built_updater.state_dict() if engine.updater else None
    state: dict[str, Any] = {
        "progress": p.state_dict(),
        # "optimizer" and "param_names" at the top, as in RETURNN's .opt.pt: RETURNN can continue from it
        "optimizer": updater.pop("optimizer") if updater else None,
        "param_names": updater["param_names"] if updater else None,
        "updater": updater,
        "grad_scaler": engine.grad_scaler.state_dict() if engine.grad_scaler else None,
        "pipeline": engine.built_pipeline.state_dict() if engine.train_pipeline and p.epoch_running else None,
        "accounting": engine.accounting.state_dict() if p.epoch_running else None,
        "rng": get_rng_state(),
        "learning_rate": {"epoch": engine.epoch_learning_rate, "step": engine.step_learning_rate},
        "grads": None,
        # a copy of the score table (the LR control's state) in case the file is lost; JSON text,
        # so that no meta value (e.g. torch's TorchVersion) needs an unpickling allow-list
        "scores": engine.scores.to_json() if engine.scores is not None else None,
    }
    if p.accum_count and engine.model is not None:  # an open accumulation window
        state["grads"] = {n: prm.grad.detach().cpu() for n, prm in engine.built_model.named_parameters()
                          if prm.grad is not None}
    if engine.lr_control is not None and hasattr(engine.lr_control, "state_dict"):
        state["lr_control"] = engine.built_lr_control.state_dict()
    return state


def load_train_state(engine: Engine, state: dict[str, Any]) -> None:
    """Put a :func:`train_state` back: optimizer, scaler, LR, data position, open window, RNG."""
    p = engine.progress
    p.load_state_dict(state["progress"])
    if state.get("optimizer") is not None:
        if "updater" in state:
            engine.built_updater.load_state_dict({**(state["updater"] or {}), "optimizer": state["optimizer"]})
        else:  # kit's earlier layout: the whole updater state under "optimizer"
            engine.built_updater.load_state_dict(state["optimizer"])
    if state.get("grad_scaler") is not None and engine.grad_scaler is not None:
        engine.grad_scaler.load_state_dict(state["grad_scaler"])
        # GradScaler creates its scale tensor on the first scale() call; an open accumulation
        # window may be unscaled (finished at the epoch end) before any step scales in this process
        engine.grad_scaler.scale(torch.zeros((), device=engine.device))
    if state.get("lr_control") is not None and hasattr(engine.lr_control, "load_state_dict"):
        engine.built_lr_control.load_state_dict(state["lr_control"])
    lr = state.get("learning_rate") or {}
    engine.epoch_learning_rate, engine.step_learning_rate = float(lr.get("epoch", 0.0)), float(lr.get("step", 0.0))
    if p.epoch_running:
        engine.built_updater.set_learning_rate(engine.step_learning_rate)
        engine.built_pipeline.load_state_dict(state["pipeline"])
        if engine.dist is None or engine.dist.is_main:  # rank 0 saved the sums of all ranks
            engine.accounting.load_state_dict(state["accounting"], engine.built_device)
        engine.built_model.train()
    if state.get("grads"):
        params = dict(engine.built_model.named_parameters())
        for name, grad in state["grads"].items():
            params[name].grad = grad.to(params[name].device)
    set_rng_state(state["rng"])


def save(engine: Engine, *, kind: str, epoch: int | None) -> Checkpoint:
    p = engine.progress
    if engine.prefix_lock is not None:
        engine.prefix_lock.check()
    return checkpoints.save(
        _prefix(engine),
        epoch=epoch if epoch is not None else p.epoch,
        model_state=engine.built_model.state_dict(),
        train_state=train_state(engine),
        global_train_step=p.global_train_step,
        effective_learning_rate=engine.step_learning_rate,
        kind=kind,
        config_digest=engine.config.digest(),
        config_keys=engine.config.key_digests(),
    )


def cleanup(engine: Engine, *, dry_run: bool = False) -> list[Checkpoint]:
    """``cleanup_old_models`` after an epoch's save: the scores it keeps the best by (no train scores)
    and the newest checkpoint protected; ``dry_run``: what it would remove (the browser's preview)."""
    options = engine.config.typed_value("cleanup_old_models")
    if not options or engine.scores is None or not engine.model_prefix:
        return []
    if dry_run:
        options = {**({} if options is True else dict(options)), "dry_run": True}
    table = engine.scores
    scores = {e: {k: v for k, v in table.scores(e).items() if not k.startswith("train_")} for e in table.epochs}
    protect = [engine.last_checkpoint] if engine.last_checkpoint is not None else []
    return checkpoints.cleanup(engine.model_prefix, options, scores=scores, protect=protect)  # logs each removal


def _prefix(engine: Engine) -> str:
    if not engine.model_prefix:
        raise ConfigError("config key 'model' is not set: saving needs a checkpoint path prefix")
    return engine.model_prefix
