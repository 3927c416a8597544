"""What a checkpoint holds besides the weights (the training state), and the engine's saves and cleanup.

:func:`train_state` / :func:`load_train_state` are everything a bit-exact continuation needs:
progress, optimizer, scaler, LR control, learning rates, data position, the epoch's loss
sums, an open accumulation window's gradients and the RNG states.
"""

from __future__ import annotations

from typing import Any

import torch

from kit import checkpoints
from kit.rng import get_rng_state, set_rng_state


def train_state(engine: Any) -> dict[str, Any]:
    """Everything besides the weights that a bit-exact continuation needs."""
    p = engine.progress
    updater = engine.updater.state_dict() if engine.updater else None
    state: dict[str, Any] = {
        "progress": p.state_dict(),
        # "optimizer" and "param_names" at the top, as in RETURNN's .opt.pt: RETURNN can continue from it
        "optimizer": updater.pop("optimizer") if updater else None,
        "param_names": updater["param_names"] if updater else None,
        "updater": updater,
        "grad_scaler": engine.grad_scaler.state_dict() if engine.grad_scaler else None,
        "pipeline": engine.train_pipeline.state_dict() if engine.train_pipeline and p.epoch_running else None,
        "accounting": engine.accounting.state_dict() if p.epoch_running else None,
        "rng": get_rng_state(),
        "learning_rate": {"epoch": engine._epoch_lr, "step": engine._step_lr},
        "grads": None,
        # a copy of the score table (the LR control's state) in case the file is lost; JSON text,
        # so that no meta value (e.g. torch's TorchVersion) needs an unpickling allow-list
        "scores": engine.scores.to_json() if engine.scores is not None else None,
    }
    if p.accum_count and engine.model is not None:  # an open accumulation window
        state["grads"] = {n: prm.grad.detach().cpu() for n, prm in engine.model.named_parameters()
                          if prm.grad is not None}
    if engine.lr_control is not None and hasattr(engine.lr_control, "state_dict"):
        state["lr_control"] = engine.lr_control.state_dict()
    return state


def load_train_state(engine: Any, state: dict[str, Any]) -> None:
    """Put a :func:`train_state` back: optimizer, scaler, LR, data position, open window, RNG."""
    p = engine.progress
    p.load_state_dict(state["progress"])
    if state.get("optimizer") is not None:
        if "updater" in state:
            engine.updater.load_state_dict({**(state["updater"] or {}), "optimizer": state["optimizer"]})
        else:  # kit's earlier layout: the whole updater state under "optimizer"
            engine.updater.load_state_dict(state["optimizer"])
    if state.get("grad_scaler") is not None and engine.grad_scaler is not None:
        engine.grad_scaler.load_state_dict(state["grad_scaler"])
        # GradScaler creates its scale tensor on the first scale() call; an open accumulation
        # window may be unscaled (finished at the epoch end) before any step scales in this process
        engine.grad_scaler.scale(torch.zeros((), device=engine.device))
    if state.get("lr_control") is not None and hasattr(engine.lr_control, "load_state_dict"):
        engine.lr_control.load_state_dict(state["lr_control"])
    lr = state.get("learning_rate") or {}
    engine._epoch_lr, engine._step_lr = float(lr.get("epoch", 0.0)), float(lr.get("step", 0.0))
    if p.epoch_running:
        engine.updater.set_learning_rate(engine._step_lr)
        engine.train_pipeline.load_state_dict(state["pipeline"])
        if getattr(engine, "dist", None) is None or engine.dist.is_main:  # rank 0 saved the sums of all ranks
            engine.accounting.load_state_dict(state["accounting"], engine.device)
        engine.model.train()
    if state.get("grads"):
        params = dict(engine.model.named_parameters())
        for name, grad in state["grads"].items():
            params[name].grad = grad.to(params[name].device)
    set_rng_state(state["rng"])


def save(engine: Any, *, kind: str, epoch: int | None) -> Any:
    p = engine.progress
    if engine.prefix_lock is not None:
        engine.prefix_lock.check()
    return checkpoints.save(
        engine.model_prefix,
        epoch=epoch if epoch is not None else p.epoch,
        model_state=engine.model.state_dict(),
        train_state=train_state(engine),
        global_train_step=p.global_train_step,
        effective_learning_rate=engine._step_lr,
        kind=kind,
        config_digest=engine.config.digest(),
        config_keys=engine.config.key_digests(),
    )


def cleanup(engine: Any) -> list[Any]:
    options = engine.config.typed_value("cleanup_old_models")
    if not options:
        return []
    table = engine.scores
    scores = {e: {k: v for k, v in table.scores(e).items() if not k.startswith("train_")} for e in table.epochs}
    protect = [engine.last_checkpoint] if engine.last_checkpoint is not None else []
    return checkpoints.cleanup(engine.model_prefix, options, scores=scores, protect=protect)  # logs each removal
