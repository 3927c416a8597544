"""The files RETURNN leaves in its run directory, and kit's part in keeping them so.

In RETURNN's layout (config key ``run_files``, see :func:`returnn_layout`) kit leaves only what RETURNN
leaves: ``{model}.NNN.pt`` (kit's manifest inside it), the optimizer states of the last two epochs,
and ``learning_rate_file`` in RETURNN's format; the CLI's event log goes to kit's state directory
(:mod:`kit.eventlog`).

RETURNN's torch engine keeps the optimizer states of the last two epochs only: after saving
``{model}.NNN.opt.pt`` it deletes ``{model}.(NNN-2).opt.pt`` (two, in case one is damaged), unless
``apply_cleanup_old_models_to_optim_states`` hands them to ``cleanup_old_models``' keep logic.
:func:`delete_old_optimizer_state` does the same after kit saves an epoch checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kit.checkpoints.foreign import has_entry, written_by_kit
from kit.checkpoints.naming import checkpoint_paths

if TYPE_CHECKING:
    from kit.config import Config

logger = logging.getLogger("kit")


def returnn_layout(config: Config) -> bool:
    """Whether the run keeps RETURNN's files only: ``run_files``, by default when the config names a
    ``learning_rate_file`` (RETURNN's score file) or its ``model`` prefix holds RETURNN's checkpoints."""
    choice = config.typed_value("run_files")
    if choice is not None:
        return bool(choice == "returnn")
    if config.typed_value("learning_rate_file"):
        return True
    from kit.compat.returnn_run import returnn_checkpoints

    prefix = config.typed_value("model")
    return bool(prefix) and bool(returnn_checkpoints(prefix))


def delete_old_optimizer_state(model_prefix: str | None, epoch: int, *, keep_logic: bool = False) -> str | None:
    """After the epoch checkpoint of ``epoch`` is saved: delete ``{model_prefix}.{epoch - 2:03d}.opt.pt``.

    RETURNN's rule (``Engine._save_optimizer``): only the optimizer state two epochs back, only when
    ``keep_logic`` (``apply_cleanup_old_models_to_optim_states``) is off; the model file stays. Returns the
    deleted path (None when there was nothing to delete). The state is deleted when kit wrote it or when it is
    RETURNN's own optimizer state (a torch archive with RETURNN's ``optimizer`` entry), as RETURNN would delete
    it; anything else under that name (damaged, another format) stays. Call it on the process that writes
    checkpoints, in RETURNN's layout.
    """
    old = epoch - 2
    if not model_prefix or keep_logic or old < 1:
        return None
    _, opt_path, _ = checkpoint_paths(model_prefix, old)
    if not (written_by_kit(opt_path) or has_entry(opt_path, "optimizer")):  # not an optimizer state of this run
        return None
    try:
        os.unlink(opt_path)
    except FileNotFoundError:
        return None
    logger.info("deleted %s (RETURNN keeps the optimizer states of the last two epochs)", opt_path)
    return opt_path
