"""RETURNN's ``cleanup_old_models`` over kit checkpoints (epoch and step kinds)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from kit.checkpoints.files import Checkpoint, delete, list_checkpoints
from kit.checkpoints.foreign import foreign_files
from kit.config.keys import CLEANUP_DEFAULTS, cleanup_problems
from kit.errors import ConfigError

logger = logging.getLogger("kit")

def _cleanup_options(options: dict | bool) -> dict | None:
    if options is False or options is None:
        return None
    if options is True:
        options = {}
    problems = cleanup_problems(options)  # the same check as when the config is read
    if problems:
        raise ConfigError(problems)
    return {**CLEANUP_DEFAULTS, **options}


def _best_epochs(epochs: list[int], scores: Mapping[int, Mapping[str, float]], keep_best_n: Any) -> set[int]:
    keys = sorted({k for e in epochs for k in scores.get(e, {})})
    keep: set[int] = set()
    for key in keys:
        n = keep_best_n.get(key, 0) if isinstance(keep_best_n, Mapping) else keep_best_n
        valued = [
            (float(scores[e][key]), e)
            for e in epochs
            if scores.get(e, {}).get(key) is not None and not math.isnan(float(scores[e][key]))
        ]
        keep.update(e for _, e in sorted(valued)[:n])
    return keep


def cleanup(
    prefix: str,
    options: dict | bool,
    *,
    scores: Mapping[int, Mapping[str, float]] | None = None,
    protect: Iterable[Checkpoint] = (),
) -> list[Checkpoint]:
    """RETURNN's ``cleanup_old_models``; returns the checkpoints removed (or, with ``dry_run``, to remove).

    Options: ``keep_last_n`` (2), ``keep_best_n`` (4 per score key, lower is better; or a dict
    key -> n), ``keep`` (epochs), ``dry_run``. Never removed: the newest complete checkpoint,
    ``protect``, and incomplete checkpoints not older than it (they may be a save in progress).
    ``keep_last_n`` applies to epoch checkpoints (as in RETURNN) and, separately, to the step
    checkpoints newer than the newest epoch checkpoint; older step checkpoints go. kit runs this
    after every save (step saves too), so that disk use stays bounded during an epoch.
    Training-state files go with their checkpoint.
    """
    opts = _cleanup_options(options)
    if opts is None:
        return []
    ckpts = list_checkpoints(prefix)
    complete = [c for c in ckpts if c.complete]
    if not complete:
        return []
    newest = complete[-1]
    protected = {c.path for c in protect} | {newest.path}
    epoch_ckpts = [c for c in complete if c.kind == "epoch"]
    epochs = sorted(c.epoch for c in epoch_ckpts)
    keep_epochs = set(opts["keep"]) | set(epochs[len(epochs) - opts["keep_last_n"]:] if opts["keep_last_n"] else ())
    keep_epochs |= _best_epochs(epochs, scores or {}, opts["keep_best_n"])
    newest_epoch_key = epoch_ckpts[-1].sort_key if epoch_ckpts else None
    # the step checkpoints of the epoch in progress: their own last n (older ones are superseded)
    recent_steps = [c for c in complete
                    if c.kind == "step" and (newest_epoch_key is None or c.sort_key > newest_epoch_key)]
    keep_last = {c.path for c in recent_steps[len(recent_steps) - opts["keep_last_n"]:]} if opts["keep_last_n"] else set()
    removable = []
    for c in ckpts:
        if c.path in protected:
            continue
        if not c.complete:
            ok = c.epoch < newest.epoch or (c.global_train_step is not None and c.sort_key < newest.sort_key)
            # RETURNN's model files (no manifest), damaged or not, are not kit's to remove
            ok = ok and not foreign_files([c.path, c.opt_path])
        elif c.kind == "epoch":
            ok = c.epoch not in keep_epochs
        else:
            ok = c.path not in keep_last
        if ok:
            removable.append(c)
    for c in removable:
        delete(c, dry_run=opts["dry_run"])
    return removable
