"""The files RETURNN leaves in its run directory, and kit's part in keeping them so.

RETURNN's torch engine keeps the optimizer states of the last two epochs only: after saving
``{model}.NNN.opt.pt`` it deletes ``{model}.(NNN-2).opt.pt`` (two, in case one is damaged), unless
``apply_cleanup_old_models_to_optim_states`` hands them to ``cleanup_old_models``' keep logic.
:func:`delete_old_optimizer_state` does the same after kit saves an epoch checkpoint.
"""

from __future__ import annotations

import logging
import os

from kit.checkpoints.naming import checkpoint_paths

logger = logging.getLogger("kit")


def delete_old_optimizer_state(model_prefix: str | None, epoch: int, *, keep_logic: bool = False) -> str | None:
    """After the epoch checkpoint of ``epoch`` is saved: delete ``{model_prefix}.{epoch - 2:03d}.opt.pt``.

    RETURNN's rule (``Engine._save_optimizer``): only the optimizer state two epochs back, only when
    ``keep_logic`` (``apply_cleanup_old_models_to_optim_states``) is off; the model file stays. Returns the
    deleted path (None when there was nothing to delete). Only a state kit wrote (its manifest is there) is
    deleted: a file RETURNN wrote stays, whatever RETURNN would do with it. Call it on the process that writes
    checkpoints, in a RETURNN run directory.
    """
    old = epoch - 2
    if not model_prefix or keep_logic or old < 1:
        return None
    _, opt_path, manifest = checkpoint_paths(model_prefix, old)
    if not os.path.isfile(manifest):  # RETURNN wrote it (or no one did): kit deletes only its own files
        return None
    try:
        os.unlink(opt_path)
    except FileNotFoundError:
        return None
    logger.info("deleted %s (RETURNN keeps the optimizer states of the last two epochs)", opt_path)
    return opt_path
