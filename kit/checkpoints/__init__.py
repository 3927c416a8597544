"""Checkpoint files: RETURNN's naming, atomic writes, a manifest that marks completeness, safe loading.

A checkpoint of epoch ``e`` under the prefix ``model`` is three files::

    model.003.pt              {"model": state_dict, "epoch", "step", "effective_learning_rate", "kit_version"}
    model.003.opt.pt          the training state (optimizer, LR control, progress, RNG, ...)
    model.003.manifest.json   sizes + sha256 of both, written last: only then the checkpoint exists

Mid-epoch checkpoints insert the global train step: ``model.003.step00001250.pt`` (+ ``.opt.pt``,
``.manifest.json``), where 3 is the epoch in progress.

Every file is written through :mod:`kit.fileio` (temp → fsync → rename → fsync dir), and every
file is read through :func:`load`, which uses ``torch.load(weights_only=True)`` — the only
``torch.load`` call in kit.

Example::

    ckpt = kit.checkpoints.save("runs/demo/model", epoch=3, model_state=model.state_dict(),
                                train_state=engine_state, global_train_step=1250)
    last = kit.checkpoints.latest("runs/demo/model")          # newest complete + verified
    model_file, train_state = kit.checkpoints.load_checkpoint(last)   # verified again while loading
    last, model_file, train_state = kit.checkpoints.load_latest("runs/demo/model")  # both, one read
    kit.checkpoints.load_into_model(model, model_file["model"])
"""

from kit.checkpoints.cleanup import cleanup
from kit.checkpoints.files import (
    MANIFEST_FORMAT,
    Checkpoint,
    CheckpointNotFoundError,
    NotSafetensorsError,
    delete,
    export_safetensors,
    latest,
    list_checkpoints,
    load,
    load_checkpoint,
    load_latest,
    save,
    verify,
)
from kit.checkpoints.lock import PrefixLock, PrefixLockedError
from kit.checkpoints.naming import ModelFileName, checkpoint_paths, parse_model_path
from kit.checkpoints.restore import apply_load_model_post_hooks, load_into_model, preload_from_files

__all__ = [
    "MANIFEST_FORMAT",
    "Checkpoint",
    "CheckpointNotFoundError",
    "ModelFileName",
    "NotSafetensorsError",
    "PrefixLock",
    "PrefixLockedError",
    "apply_load_model_post_hooks",
    "checkpoint_paths",
    "cleanup",
    "delete",
    "export_safetensors",
    "latest",
    "list_checkpoints",
    "load",
    "load_checkpoint",
    "load_into_model",
    "load_latest",
    "parse_model_path",
    "preload_from_files",
    "save",
    "verify",
]
