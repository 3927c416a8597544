"""Debug hook instead of a debug shell: the failing step's context handed back as an object.

RETURNN's ``debug_shell_before_train_loop`` opens a blocking terminal shell (dead in
Jupyter) and its NaN check runs after the bad update. In kit a hook gets a
:class:`DebugContext` on these events, while the loop state is intact.

The debugger subscribes to the engine's bus (``epoch_begin``, ``exception``, ``nonfinite``):

- ``before_train_loop`` — start of every train epoch
- ``exception`` — any exception from user code in train, eval or forward
- ``nonfinite`` — the non-finite guard fired, *before* the update (weights unchanged)
- ``step`` — ``session.break_on(step=..., when=...)`` matched

Hooks: :func:`capture` (default: keep it as ``session.last_failure``), :func:`post_mortem`
(pdb / IPython debugger in the failing frame), :func:`raise_` (re-raise), or any callable.
A hook runs with the RNG states put back afterwards, so looking never changes training.
:func:`replay` re-runs the captured step under a tracer that names the first operation,
module and source line that produced a NaN/Inf.

>>> session.debug_hook = kit.debug.capture      # doctest: +SKIP
>>> session.train()                              # doctest: +SKIP
NonFiniteLossError: non-finite values at epoch 1, step 5 ...
>>> session.last_failure.batch.seq_tags          # doctest: +SKIP
>>> session.replay()                             # doctest: +SKIP
first NaN/Inf: aten.div.Tensor in module scale (Scale), forward, from finite inputs ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kit.debug.hooks import DebugStop, capture, post_mortem, raise_
from kit.engine.debugging import DEBUG_EVENTS, DebugContext, Debugger, rng_kept

if TYPE_CHECKING:
    from kit.debug.replay_step import Replayable, ReplayReport

__all__ = ["DEBUG_EVENTS", "DebugContext", "DebugStop", "Debugger", "Finding", "ReplayReport", "capture",
           "post_mortem", "raise_", "replay", "rng_kept"]


def replay(engine: Replayable, ctx: DebugContext, *, anomaly: bool = True) -> ReplayReport:
    """Re-run exactly the captured step and name the first op/module/line that made a NaN/Inf.

    Returns a :class:`kit.debug.ReplayReport`; see :mod:`kit.debug.replay_step`.
    """
    from kit.debug.replay_step import replay_step

    return replay_step(engine, ctx, anomaly=anomaly)


def __getattr__(name: str) -> Any:
    if name in ("ReplayReport", "Finding"):
        import kit.debug.replay_step

        return getattr(kit.debug.replay_step, name)
    raise AttributeError(f"module 'kit.debug' has no attribute {name!r}")
