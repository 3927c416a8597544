"""RETURNN's frontend seeded where RETURNN's torch engine seeds it: before ``get_model`` and at each epoch start.

``rf.set_random_seed(seed)`` seeds torch (as kit's ``seed_all`` does with the same number) and, beyond
that, RETURNN's step-based random state, from which ``rf.Module`` parameters are initialised
(``rf.random(..., static=True)``). Without it, an ``rf.Module`` model starts from other weights than
under RETURNN. Nothing here imports RETURNN: the seed reaches RETURNN's frontend only when a config
has loaded it; a seed given before that is applied when the frontend is first used
(:func:`apply_pending_seed`, from the ``get_model`` wrapper).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from kit.compat.imports import is_fallback_module

_lock = threading.Lock()
_pending: int | None = None


def _loaded_frontend() -> Any:
    """RETURNN's real ``returnn.frontend`` when some config has imported it, else None."""
    module = sys.modules.get("returnn.frontend")
    if module is None or is_fallback_module(module) or not hasattr(module, "set_random_seed"):
        return None
    return module


def seed_returnn_frontend(seed: int) -> None:
    """``rf.set_random_seed(seed)`` as RETURNN's torch engine calls it (torch backend selected first).

    Call it with the seed kit has just given torch: RETURNN's model-init seed before ``get_model``, its
    epoch seed at each epoch start. A no-op for torch's state (the same seed again); without a loaded
    RETURNN frontend the seed is kept for :func:`apply_pending_seed`.
    """
    global _pending
    rf = _loaded_frontend()
    with _lock:
        _pending = None if rf is not None else int(seed)
    if rf is not None:
        rf.select_backend_torch()
        rf.set_random_seed(int(seed))


def apply_pending_seed() -> None:
    """Seed RETURNN's frontend with the last seed given while it was not loaded yet (if any), once."""
    global _pending
    with _lock:
        seed, _pending = _pending, None
    if seed is not None:
        seed_returnn_frontend(seed)
