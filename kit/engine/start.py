"""Where a run starts: the epoch, the weights and the training state it continues from.

Training (RETURNN's ``task="train"``; first match wins):

1. ``start_epoch=1``: a fresh model (existing checkpoints are ignored, with a warning).
2. ``start_epoch=N``: the checkpoint of epoch N-1 (or the ``load`` file's weights).
3. the newest complete, verified checkpoint under ``model`` (epoch or mid-epoch step); a
   broken newer one is skipped with a warning. ``load`` / ``load_epoch`` are then ignored,
   as in RETURNN: a re-run continues where the last one stopped.
4. ``import_model_train_epoch1``: its weights, training starts at epoch 1.
5. ``load_epoch`` without any checkpoint: an error.
6. ``load``: a kit checkpoint continues with its whole training state; any other model file
   gives the weights, and training continues after the epoch stored in (or named by) it.
7. a fresh model.

Not training (eval / forward, or a config without ``train`` / ``train_step``): ``load``, else
the checkpoint of ``load_epoch``, else the newest checkpoint, else a fresh model — weights only.

Then ``preload_from_files`` (entries with ``init_for_train=True`` only when training starts
fresh, the others only when not training) and ``load_model_post_hooks``.

On a training start at epoch ``s`` the score table forgets the scores of epochs >= s (a
killed run may have written some; they are trained again), keeps stored learning rates, and
gets back rows it lost from the copy inside the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from kit import checkpoints
from kit.checkpoints.naming import parse_model_path
from kit.compat.returnn_run import returnn_start
from kit.config import Config
from kit.engine.parts import eval_datasets
from kit.errors import CheckpointError, ConfigError

logger = logging.getLogger("kit")


@dataclass
class Start:
    """Where a run starts: the epoch to train (or the next one), weights and training state."""

    epoch: int = 1
    global_train_step: int = 0
    model_state: dict | None = None
    train_state: dict | None = None
    source: str = "fresh"
    needs_eval: bool = False
    first_train_epoch: bool = True  # RETURNN: preload entries with init_for_train=True apply
    import_path: str | None = None  # import_model_train_epoch1, loaded by init_weights
    checkpoint: Any = None  # the kit checkpoint it starts from


# ---- choosing the start ------------------------------------------------------------------


def can_train(config: Config) -> bool:
    return config.typed_value("train") is not None and config.typed_value("train_step") is not None


def find_start(config: Config, scores: Any, *, training: bool | None = None) -> Start:
    """Decide where the run starts (see the module docstring); aligns ``scores`` when training."""
    if training is None:
        training = can_train(config)
    if not training:
        start = _find_eval_start(config)
        start.train_state = None
        return start
    start = _find_train_start(config)
    refuse_foreign_ahead(config, start.epoch)
    _align_scores(scores, start, last=_num_epochs(config))
    start.needs_eval = _needs_eval(config, scores, start)
    return start


def refuse_foreign_ahead(config: Config, first_epoch: int) -> None:
    """Before any training: a CheckpointError when an epoch this run will save (``first_epoch`` to
    ``num_epochs``) has a file kit did not write under its name (RETURNN's, or a damaged one that
    made kit fall back past it); kit never replaces such a file, and would otherwise find out only
    after training that epoch."""
    from kit.checkpoints.files import foreign_files_of

    prefix = config.typed_value("model")
    if not prefix:
        return
    last = _num_epochs(config)
    for ckpt in checkpoints.list_checkpoints(prefix):
        if ckpt.kind != "epoch" or not first_epoch <= ckpt.epoch <= last:
            continue
        if found := foreign_files_of(ckpt.path, ckpt.opt_path, ckpt.manifest_path):
            raise CheckpointError(
                f"training starts at epoch {first_epoch}, and saving epoch {ckpt.epoch} would replace "
                f"{', '.join(found)}, which was not written by kit (RETURNN's file, or one that does not load, so "
                f"kit could not continue from it); kit never overwrites such a file. Move it away (kit then "
                "continues from the checkpoint before it), set num_epochs below its epoch, or use another "
                "'model' path")


def _find_train_start(config: Config) -> Start:
    prefix = config.typed_value("model")
    start_epoch = _start_epoch(config)
    load = config.typed_value("load")
    if start_epoch == 1:
        if prefix and any(c.complete for c in checkpoints.list_checkpoints(prefix)):
            logger.warning("start_epoch=1: ignoring the existing checkpoints under %r; training starts anew", prefix)
        return _fresh_or_import(config, "start_epoch=1")
    if start_epoch is not None:
        if load:  # RETURNN: the load file's weights, the epoch of start_epoch
            start = _start_from_file(load, training=True, with_train_state=False)
            start.epoch, start.first_train_epoch = start_epoch, False
            return start
        return _start_from(_epoch_checkpoint(prefix, start_epoch - 1, "start_epoch"), f"start_epoch={start_epoch}")
    if (returnn := returnn_start(prefix, training=True)) is not None:  # a RETURNN run, newer than kit's files
        return Start(**returnn)
    if prefix and (loaded := checkpoints.load_latest(prefix)) is not None:
        if load or config.typed_value("import_model_train_epoch1"):
            logger.info("resuming from the existing checkpoint %s; 'load' / 'import_model_train_epoch1' are ignored",
                        loaded[0].name)
        return _start_from(loaded[0], "resume", loaded=loaded[1:])
    if config.typed_value("import_model_train_epoch1"):
        return _fresh_or_import(config, "fresh")
    if config.typed_value("load_epoch"):
        return _start_from(_epoch_checkpoint(prefix, int(config.typed_value("load_epoch")), "load_epoch"), "load_epoch")
    if load:
        return _start_from_file(load, training=True)
    return Start()


def _find_eval_start(config: Config) -> Start:
    prefix = config.typed_value("model")
    if config.typed_value("load"):
        return _start_from_file(config.typed_value("load"), training=False)
    if config.typed_value("load_epoch"):
        ckpt = _epoch_checkpoint(prefix, int(config.typed_value("load_epoch")), "load_epoch")
        return _start_from(ckpt, "load_epoch", with_train_state=False)
    if (returnn := returnn_start(prefix, training=False)) is not None:
        return Start(**returnn)
    if prefix and (loaded := checkpoints.load_latest(prefix, load_train_state=False)) is not None:
        return _start_from(loaded[0], "newest checkpoint", with_train_state=False, loaded=loaded[1:])
    return Start(first_train_epoch=False)


def _start_epoch(config: Config) -> int | None:
    value = config.typed_value("start_epoch")
    if value in ("auto", None):
        return None
    try:
        epoch = int(value)
    except (TypeError, ValueError):
        epoch = 0
    if epoch < 1:
        raise ConfigError(f"config key 'start_epoch': got {value!r}, expected 'auto' or an epoch >= 1")
    return epoch


def _fresh_or_import(config: Config, source: str) -> Start:
    path = config.typed_value("import_model_train_epoch1")
    if not path:
        return Start(source=source)
    return Start(source=f"import_model_train_epoch1={path!r}", import_path=_resolve_file(path, "import_model_train_epoch1"))


def _epoch_checkpoint(prefix: str | None, epoch: int, key: str) -> Any:
    if not prefix:
        raise ConfigError(f"config key '{key}': needs the checkpoint of epoch {epoch}, but 'model' is not set")
    found = [c for c in checkpoints.list_checkpoints(prefix) if c.kind == "epoch" and c.epoch == epoch and c.complete]
    if not found:
        have = sorted({c.epoch for c in checkpoints.list_checkpoints(prefix) if c.kind == "epoch" and c.complete})
        raise CheckpointError(f"config key '{key}': no complete checkpoint of epoch {epoch} under '{prefix}' "
                              f"(complete epoch checkpoints: {have or 'none'})")
    return found[-1]


def _start_from(ckpt: Any, source: str, *, with_train_state: bool = True, loaded: tuple | None = None) -> Start:
    """Start from ``ckpt``; ``loaded`` = its (model file, training state) if already loaded."""
    model_file, train_state = loaded or checkpoints.load_checkpoint(ckpt, load_train_state=with_train_state)
    step = int(model_file.get("step", ckpt.global_train_step or 0) or 0)
    if train_state is not None:
        progress = train_state.get("progress", {})
        epoch = int(progress.get("epoch", ckpt.epoch + 1))
        step = int(progress.get("global_train_step", step))
    else:
        # without the data position a step checkpoint can only restart its epoch
        epoch = ckpt.epoch + 1 if ckpt.kind == "epoch" else ckpt.epoch
        if with_train_state:
            logger.warning("checkpoint %s has no training state: continuing with its weights only, "
                           "fresh optimizer, at the start of epoch %d", ckpt.name, epoch)
    logger.info("starting from %s (%s): epoch %d, global step %d", ckpt.path, source, epoch, step)
    return Start(epoch=epoch, global_train_step=step, model_state=model_file["model"], train_state=train_state,
                 source=f"{source}: {ckpt.path}", first_train_epoch=False, checkpoint=ckpt)


def _resolve_file(path: Any, key: str) -> str:
    """The file a ``load`` / ``import_model_train_epoch1`` value names (RETURNN allows leaving out ``.pt``)."""
    path = os.fspath(path)
    for candidate in (path, path + ".pt"):
        if os.path.isfile(candidate):
            return candidate
    raise CheckpointError(f"config key '{key}': file {path!r} does not exist")


def _as_checkpoint(path: str) -> Any:
    """The kit checkpoint whose model file is ``path``, when it has a manifest; else None."""
    name = parse_model_path(path)
    if name is None:
        return None
    for ckpt in checkpoints.list_checkpoints(name.prefix):
        if os.path.abspath(ckpt.path) == os.path.abspath(path) and ckpt.complete:
            return ckpt
    return None


def _start_from_file(value: Any, *, training: bool, with_train_state: bool = True) -> Start:
    """``load``: a kit checkpoint (verified, with its training state when training) or a model file."""
    path = _resolve_file(value, "load")
    ckpt = _as_checkpoint(path)
    if ckpt is not None:
        return _start_from(ckpt, f"load={value!r}", with_train_state=training and with_train_state)
    model_file = checkpoints.load(path)
    state = model_file.get("model", model_file) if isinstance(model_file, dict) else model_file
    if not isinstance(state, dict):
        raise CheckpointError(f"config key 'load': {path} holds a {type(state).__name__}, not a state dict")
    epoch, step = 0, 0
    if isinstance(model_file, dict) and "model" in model_file:
        epoch, step = int(model_file.get("epoch") or 0), int(model_file.get("step") or 0)
    if not epoch and (name := parse_model_path(path)):
        epoch = name.epoch
    return Start(epoch=epoch + 1, global_train_step=step, model_state=state, source=f"load={value!r}",
                 first_train_epoch=epoch == 0)


# ---- the score table at a training start -------------------------------------------------


def _num_epochs(config: Config) -> int:
    try:
        return int(config.typed_value("num_epochs") or 0)
    except (TypeError, ValueError):
        return 0  # the config check names it


def _align_scores(scores: Any, start: Start, *, last: int) -> None:
    """Rows lost from the file come back from the checkpoint; scores of epochs >= start are dropped."""
    state = scores.state_dict()
    snapshot = (start.train_state or {}).get("scores")
    changed = False
    if snapshot:
        snapshot = json.loads(snapshot)
        for epoch, row in snapshot.get("epochs", {}).items():
            if int(epoch) < start.epoch and int(epoch) not in state["epochs"]:
                state["epochs"][int(epoch)] = row
                changed = True
        state["error_keys"] = sorted(set(state["error_keys"]) | set(snapshot.get("error_keys", ())))
    for epoch, row in list(state["epochs"].items()):
        # rows of epochs this run trains again are forgotten; rows past its end (e.g. a RETURNN row of a
        # far epoch) are not this run's to touch
        if start.epoch <= epoch <= last and (row["scores"] or row["meta"]):
            row["scores"], row["meta"], changed = {}, {}, True
            if row["learning_rate"] is None:
                del state["epochs"][epoch]
    progress = (start.train_state or {}).get("progress", {})
    if progress.get("epoch_running"):  # the lr the interrupted epoch was trained with
        lr = float((start.train_state or {})["learning_rate"]["epoch"])
        row = state["epochs"].setdefault(start.epoch, {"learning_rate": None, "scores": {}, "meta": {}})
        changed = changed or row["learning_rate"] != lr
        row["learning_rate"] = lr
    if changed:
        scores.load_state_dict(state)
        if scores.path:
            scores.save()


def _needs_eval(config: Config, scores: Any, start: Start) -> bool:
    """RETURNN's missing-eval rule: the last finished epoch unevaluated → eval now; an older one → error.

    Only for starts from a kit checkpoint: a foreign model file (``load``) has no score history.
    """
    names = list(eval_datasets({k: None for k in _eval_keys(config)}))
    last = start.epoch - 1
    if start.checkpoint is None or last < 1 or not names:
        return False
    for epoch in scores.epochs:
        if epoch < last and scores.has_scores(epoch, prefix="train_loss_"):
            missing = [n for n in names if not scores.has_scores(epoch, prefix=f"{n}_loss_")]
            if missing:
                raise CheckpointError(
                    f"score table {scores.path!r}: epoch {epoch} has no scores for eval dataset(s) "
                    f"{', '.join(map(repr, missing))}, and only the last finished epoch ({last}) can be evaluated "
                    "when training resumes; remove them from the eval datasets or use a new 'model' path")
    missing_last = [n for n in names if not scores.has_scores(last, prefix=f"{n}_loss_")]
    if not missing_last:
        return False
    if (start.train_state or {}).get("progress", {}).get("epoch_running"):
        logger.warning("epoch %d has no scores for %s, but training resumes in the middle of epoch %d: "
                       "the model of epoch %d is not evaluated", last, ", ".join(missing_last), start.epoch, last)
        return False
    logger.info("epoch %d has no scores for %s: evaluating it now", last, ", ".join(missing_last))
    return True


def _eval_keys(config: Config) -> list[str]:
    keys = [k for k in ("dev", "eval") if config.typed_value(k) is not None]
    return keys + [f"eval_datasets.{n}" for n in (config.typed_value("eval_datasets") or {})]


# ---- weights ----------------------------------------------------------------------------


def init_weights(config: Config, model: torch.nn.Module, start: Start, *, training: bool) -> None:
    """Copy the start weights into the fresh model, then preload and run the post-load hooks.

    As in RETURNN, the weights may miss keys that a ``preload_from_files`` entry fills;
    whatever is still missing afterwards is an error listing the keys.
    """
    state, what = start.model_state, start.source
    if start.import_path is not None:
        model_file = checkpoints.load(start.import_path)
        state = model_file.get("model", model_file) if isinstance(model_file, dict) else model_file
        logger.info("initialized epoch 1 from %s (import_model_train_epoch1)", start.import_path)
    preload = {
        name: opts
        for name, opts in (config.typed_value("preload_from_files") or {}).items()
        # RETURNN: init_for_train=True → only when training starts fresh; False → only when not training
        if (bool(opts.get("init_for_train", False)) and training and start.first_train_epoch)
        or (not opts.get("init_for_train", False) and not training)
    }
    missing: set[str] = set()
    if state is not None:
        tensors = {k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        missing = tensors - set(state)
        checkpoints.load_into_model(model, state, strict=False)
    if preload:
        missing -= set(checkpoints.preload_from_files(model, preload, is_training_start=training))
    if missing:
        raise CheckpointError(f"while loading {what}: missing key(s) in state_dict: "
                              f"{', '.join(map(repr, sorted(missing)))}"
                              + (" (preload_from_files did not fill them either)" if preload else ""))
    hooks = config.typed_value("load_model_post_hooks")
    if hooks:
        checkpoints.apply_load_model_post_hooks(model, hooks)


# keys that a resumed run may change without it being another run
_RESUME_FREE_KEYS = {"num_epochs", "log_every_n_steps", "log_verbosity", "device", "debug_hook",
                     "torch_log_memory_usage", "cleanup_old_models", "save_every_n_steps"}


def warn_config_changes(config: Config, start: Start) -> None:
    """On a resume, a warning naming the config keys that differ from the checkpoint's run."""
    if start.checkpoint is None:
        return
    try:
        manifest = start.checkpoint.manifest()
    except CheckpointError:
        return
    stored = manifest.get("config_keys") or {}
    if not stored:  # written by an older kit: only the overall digest, no key names
        if manifest.get("config_digest") not in ("", None, config.digest()):
            logger.warning("resuming from %s, written with another config (digest %s, now %s)",
                           start.checkpoint.name, manifest["config_digest"], config.digest())
        return
    now = config.key_digests()
    changed = sorted(k for k in set(stored) | set(now) if stored.get(k) != now.get(k) and k not in _RESUME_FREE_KEYS)
    if changed:
        logger.warning("resuming from %s, but the config changed since it was written: %s (continuing with the "
                       "new values; use another 'model' path to start a separate run)",
                       start.checkpoint.name, ", ".join(changed))


def resume_plan(config: Config, final_epoch: int) -> str | None:
    """Before set-up: where training will continue ("will resume from model.002, epoch 3"), read from the
    newest complete checkpoint's name (nothing is built, loaded or verified); None when it starts fresh."""
    returnn_epoch = newest_returnn_epoch(config)
    if returnn_epoch is not None:
        name = f"{os.path.basename(config.typed_value('model'))}.{returnn_epoch:03d} (RETURNN's)"
        if returnn_epoch >= final_epoch:
            return f"trained to epoch {returnn_epoch} (num_epochs={final_epoch}), from {name}"
        return f"will resume from {name}, epoch {returnn_epoch + 1}"
    newest = newest_complete(config)
    if newest is None:
        return None
    if newest.kind == "epoch" and newest.epoch >= final_epoch:
        return f"trained to epoch {newest.epoch} (num_epochs={final_epoch}), from {newest.name}"
    epoch, step = planned_position(newest)
    return f"will resume from {newest.name}, epoch {epoch}" + (f", global step {step}" if newest.kind == "step" else "")


def newest_returnn_epoch(config: Config) -> int | None:
    """The newest epoch RETURNN itself saved under ``model`` (by file name: nothing is loaded), when it is
    newer than kit's own newest epoch checkpoint; None otherwise."""
    from kit.compat.returnn_run import returnn_checkpoints

    prefix = config.typed_value("model")
    if not prefix or config.typed_value("start_epoch") not in ("auto", None):
        return None
    found = returnn_checkpoints(prefix)
    kit_newest = newest_complete(config)
    if not found or (kit_newest is not None and kit_newest.epoch >= found[-1].epoch):
        return None
    return found[-1].epoch


def newest_complete(config: Config) -> Any:
    """The newest complete checkpoint under ``model`` that a training start would continue from (by its
    name: nothing is loaded); None when training would start fresh."""
    from kit.checkpoints import list_checkpoints

    prefix = config.typed_value("model")
    if not prefix or config.typed_value("start_epoch") not in ("auto", None):
        return None
    return next((c for c in reversed(list_checkpoints(prefix)) if c.complete), None)


def planned_position(ckpt: Any) -> tuple[int, int]:
    """(epoch, global train step) where training continues after checkpoint ``ckpt``."""
    return (ckpt.epoch + 1 if ckpt.kind == "epoch" else ckpt.epoch), int(ckpt.global_train_step or 0)
