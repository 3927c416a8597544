"""The engine's checkpoint files: a :class:`~kit.engine.state.TrainingState` written as a checkpoint, and
``cleanup_old_models`` after each save."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kit import checkpoints
from kit.compat.run_files import returnn_layout
from kit.errors import ConfigError

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.checkpoints.lock import PrefixLock
    from kit.config import Config
    from kit.engine.state import TrainingState
    from kit.scores import ScoreTable


def save(config: Config, state: TrainingState, *, kind: str, epoch: int, lock: PrefixLock | None) -> Checkpoint:
    """Write ``state`` as a checkpoint under the config's ``model`` prefix (weights to the model file)."""
    prefix = config.typed_value("model")
    if not prefix:
        raise ConfigError("config key 'model' is not set: saving needs a checkpoint path prefix")
    if lock is not None:
        lock.check()
    assert state.weights is not None, "a checkpoint needs the weights"
    lrs = state.learning_rates or {}
    return checkpoints.save(
        prefix,
        epoch=epoch,
        model_state=state.weights,
        train_state=state.to_file(),
        global_train_step=state.progress.global_train_step,
        effective_learning_rate=lrs.get("step", 0.0),
        kind=kind,
        config_digest=config.digest(),
        config_keys=config.key_digests(),
        layout="returnn" if returnn_layout(config) else "kit",
    )


def cleanup(config: Config, scores: ScoreTable | None, protect: Checkpoint | None, *,
            dry_run: bool = False) -> list[Checkpoint]:
    """``cleanup_old_models`` after a save: the scores it keeps the best by (no train scores), the newest
    checkpoint protected; ``dry_run``: what it would remove (the browser's preview)."""
    options: Any = config.typed_value("cleanup_old_models")
    prefix = config.typed_value("model")
    if not options or scores is None or not prefix:
        return []
    if dry_run:
        options = {**({} if options is True else dict(options)), "dry_run": True}
    by_epoch = {e: {k: v for k, v in scores.scores(e).items() if not k.startswith("train_")} for e in scores.epochs}
    return checkpoints.cleanup(prefix, options, scores=by_epoch, protect=[protect] if protect is not None else [])


def drop_old_optimizer_state(config: Config, ckpt: Checkpoint) -> None:
    """After an epoch checkpoint saved in RETURNN's layout (``run_files``; the save decided it), leave what
    RETURNN would: the optimizer states of the last two epochs only (``kit.compat.run_files``); kit's own runs
    keep them all, so that any epoch can be restored."""
    from kit.compat.run_files import delete_old_optimizer_state

    if ckpt.embedded:
        delete_old_optimizer_state(config.typed_value("model"), ckpt.epoch,
                                   keep_logic=config.bool("apply_cleanup_old_models_to_optim_states"))
