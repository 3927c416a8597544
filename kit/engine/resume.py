"""Where training starts, and the engine's state in and out of checkpoints.

Start rule (first match wins): the newest complete checkpoint under ``model``
(``start_epoch='auto'``) → ``start_epoch=N`` (the checkpoint of epoch N-1) →
``load_epoch`` → ``load`` (a file) → ``import_model_train_epoch1`` (weights only, epoch 1)
→ a fresh model (with ``preload_from_files``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from kit import checkpoints
from kit.config import Config
from kit.errors import CheckpointError, ConfigError
from kit.rng import get_rng_state, set_rng_state

logger = logging.getLogger("kit")


@dataclass
class Start:
    epoch: int = 1
    global_train_step: int = 0
    model_state: dict | None = None
    train_state: dict | None = None
    source: str = "fresh"
    needs_eval: bool = False


# ---- datasets and stores ----------------------------------------------------------------


def build_datasets(config: Config) -> dict[str, Any]:
    from kit.data import make_dataset

    out: dict[str, Any] = {}
    for key in ("train", "dev", "eval"):
        value = config.typed_value(key)
        if value is not None:
            out[key] = _make(make_dataset, value, key)
    for name, value in (config.typed_value("eval_datasets") or {}).items():
        out[f"eval_datasets.{name}"] = _make(make_dataset, value, f"eval_datasets[{name!r}]")
    return out


def _make(make_dataset: Any, value: Any, key: str) -> Any:
    try:
        return make_dataset(value)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"config key '{key}': {exc}") from None


def eval_datasets(datasets: dict[str, Any]) -> dict[str, Any]:
    """Name → dataset for the datasets evaluated after each epoch (dev, eval, eval_datasets)."""
    out = {k: v for k, v in datasets.items() if k in ("dev", "eval")}
    out.update({k.split(".", 1)[1]: v for k, v in datasets.items() if k.startswith("eval_datasets.")})
    return out


def build_extern_data(config: Config) -> Any:
    spec = config.typed_value("extern_data")
    if spec is None:
        return None
    from kit.data import ExternData

    return ExternData(spec)


def score_file_path(config: Config) -> str | None:
    path = config.typed_value("learning_rate_file")
    if path:
        return path
    prefix = config.typed_value("model")
    return f"{prefix}.scores.json" if prefix else None


def open_score_table(config: Config) -> Any:
    from kit.scores import ScoreTable

    path = score_file_path(config)
    if path and os.path.exists(path):
        return ScoreTable.load(path)
    return ScoreTable(path)


# ---- choosing the start ------------------------------------------------------------------


def find_start(config: Config, scores: Any) -> Start:
    prefix = config.typed_value("model")
    start_epoch = config.typed_value("start_epoch")
    if start_epoch not in ("auto", None):
        return _start_at_epoch(prefix, int(start_epoch))
    if prefix and (ckpt := checkpoints.latest(prefix)) is not None:
        start = _start_from(ckpt, "resume")
        start.needs_eval = _needs_eval(config, scores, ckpt)
        return start
    if config.typed_value("load_epoch"):
        return _start_at_epoch(prefix, int(config.typed_value("load_epoch")) + 1)
    if config.typed_value("load"):
        model_file = checkpoints.load(config.typed_value("load"))
        state = model_file.get("model", model_file) if isinstance(model_file, dict) else model_file
        epoch = int(model_file.get("epoch", 0)) if isinstance(model_file, dict) else 0
        return Start(epoch=epoch + 1, global_train_step=int(model_file.get("step", 0) or 0),
                     model_state=state, source=f"load={config.typed_value('load')!r}")
    return Start()


def _start_at_epoch(prefix: str | None, epoch: int) -> Start:
    if epoch <= 1:
        return Start()
    if not prefix:
        raise ConfigError(f"config key 'start_epoch'/'load_epoch': epoch {epoch} needs checkpoints, but 'model' is not set")
    wanted = [c for c in checkpoints.list_checkpoints(prefix) if c.kind == "epoch" and c.epoch == epoch - 1]
    if not wanted or not wanted[-1].complete:
        raise CheckpointError(f"no complete checkpoint of epoch {epoch - 1} under '{prefix}' to start epoch {epoch} from")
    return _start_from(wanted[-1], f"epoch {epoch - 1} checkpoint")


def _start_from(ckpt: Any, source: str) -> Start:
    model_file, train_state = checkpoints.load_checkpoint(ckpt)
    progress = (train_state or {}).get("progress", {})
    epoch = int(progress.get("epoch", ckpt.epoch + 1))
    step = int(progress.get("global_train_step", model_file.get("step", 0) or 0))
    logger.info("resuming from %s (%s): epoch %d, global step %d", ckpt.path, source, epoch, step)
    return Start(epoch=epoch, global_train_step=step, model_state=model_file["model"], train_state=train_state,
                 source=f"{source}: {ckpt.path}")


def _needs_eval(config: Config, scores: Any, ckpt: Any) -> bool:
    """RETURNN's missing-eval rule: last epoch unevaluated → eval now; an older one → error."""
    names = list(eval_datasets({k: None for k in _eval_keys(config)}))
    if ckpt.kind != "epoch" or not names:
        return False
    missing_last = [n for n in names if not scores.has_scores(ckpt.epoch, prefix=f"{n}_loss_")]
    for epoch in scores.epochs:
        if epoch < ckpt.epoch and scores.has_scores(epoch, prefix="train_loss_"):
            for n in names:
                if not scores.has_scores(epoch, prefix=f"{n}_loss_"):
                    raise CheckpointError(
                        f"score table {scores.path!r}: epoch {epoch} has no scores for eval dataset {n!r}, "
                        f"and only the last epoch ({ckpt.epoch}) can be evaluated again; remove {n!r} from "
                        "the eval datasets or use a new 'model' path")
    return bool(missing_last)


def _eval_keys(config: Config) -> list[str]:
    keys = [k for k in ("dev", "eval") if config.typed_value(k) is not None]
    return keys + [f"eval_datasets.{n}" for n in (config.typed_value("eval_datasets") or {})]


# ---- weights ----------------------------------------------------------------------------


def init_weights(engine: Any, start: Start) -> None:
    """Copy the start weights into the fresh model, or import / preload for a fresh start."""
    config, model = engine.config, engine.model
    if start.model_state is not None:
        checkpoints.load_into_model(model, start.model_state)
    elif start.epoch == 1 and config.typed_value("import_model_train_epoch1"):
        path = config.typed_value("import_model_train_epoch1")
        model_file = checkpoints.load(path)
        checkpoints.load_into_model(model, model_file.get("model", model_file))
        logger.info("initialized epoch 1 from %s", path)
    preload = config.typed_value("preload_from_files") or {}
    training = config.typed_value("train") is not None and config.typed_value("train_step") is not None
    fresh = start.model_state is None
    for name, opts in preload.items():
        for_train = bool(opts.get("init_for_train", False))
        # RETURNN: init_for_train=True → only when training starts fresh; False → only when not training
        if (for_train and training and fresh) or (not for_train and not training):
            checkpoints.preload_from_files(model, {name: opts}, is_training_start=for_train)
    hooks = config.typed_value("load_model_post_hooks")
    if hooks:
        checkpoints.apply_load_model_post_hooks(model, list(hooks))


# ---- training state ---------------------------------------------------------------------


def train_state(engine: Any) -> dict[str, Any]:
    """Everything besides the weights that a bit-exact continuation needs."""
    p = engine.progress
    state: dict[str, Any] = {
        "progress": p.state_dict(),
        "optimizer": engine.updater.state_dict() if engine.updater else None,
        "grad_scaler": engine.grad_scaler.state_dict() if engine.grad_scaler else None,
        "pipeline": engine.train_pipeline.state_dict() if engine.train_pipeline and p.epoch_running else None,
        "accounting": engine.accounting.state_dict() if p.epoch_running else None,
        "rng": get_rng_state(),
        "learning_rate": {"epoch": engine._epoch_lr, "step": engine._step_lr},
        "grads": None,
    }
    if p.accum_count and engine.model is not None:  # an open accumulation window
        state["grads"] = {n: prm.grad.detach().cpu() for n, prm in engine.model.named_parameters()
                          if prm.grad is not None}
    if engine.lr_control is not None and hasattr(engine.lr_control, "state_dict"):
        state["lr_control"] = engine.lr_control.state_dict()
    return state


def load_train_state(engine: Any, state: dict[str, Any]) -> None:
    p = engine.progress
    p.load_state_dict(state["progress"])
    if state.get("optimizer") is not None:
        engine.updater.load_state_dict(state["optimizer"])
    if state.get("grad_scaler") is not None and engine.grad_scaler is not None:
        engine.grad_scaler.load_state_dict(state["grad_scaler"])
    if state.get("lr_control") is not None and hasattr(engine.lr_control, "load_state_dict"):
        engine.lr_control.load_state_dict(state["lr_control"])
    lr = state.get("learning_rate") or {}
    engine._epoch_lr, engine._step_lr = float(lr.get("epoch", 0.0)), float(lr.get("step", 0.0))
    if p.epoch_running:
        engine.updater.set_learning_rate(engine._step_lr)
        engine.train_pipeline.load_state_dict(state["pipeline"])
        engine.accounting.load_state_dict(state["accounting"], engine.device)
        engine.model.train()
    if state.get("grads"):
        params = dict(engine.model.named_parameters())
        for name, grad in state["grads"].items():
            params[name].grad = grad.to(params[name].device)
    set_rng_state(state["rng"])


def save(engine: Any, *, kind: str, epoch: int | None) -> Any:
    p = engine.progress
    return checkpoints.save(
        engine.model_prefix,
        epoch=epoch if epoch is not None else p.epoch,
        model_state=engine.model.state_dict(),
        train_state=train_state(engine),
        global_train_step=p.global_train_step,
        effective_learning_rate=engine._step_lr,
        kind=kind,
        config_digest=engine.config.digest(),
    )


def cleanup(engine: Any) -> list[Any]:
    options = engine.config.typed_value("cleanup_old_models")
    if not options:
        return []
    table = engine.scores
    scores = {e: {k: v for k, v in table.scores(e).items() if not k.startswith("train_")} for e in table.epochs}
    protect = [engine.last_checkpoint] if engine.last_checkpoint is not None else []
    removed = checkpoints.cleanup(engine.model_prefix, options, scores=scores, protect=protect)
    for ckpt in removed:
        logger.info("cleanup_old_models: removed %s", ckpt.path)
    return removed


def state_tensors_to(state: Any, device: torch.device) -> Any:
    """Move every tensor in a nested state to ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: state_tensors_to(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(state_tensors_to(v, device) for v in state)
    return state
