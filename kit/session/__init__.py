"""The notebook's side of kit: :class:`Session`, an incremental facade over the engine's loop.

Its rooms: the facade (:mod:`~kit.session.facade`), the loop driver that steps the engine's
units synchronously, awaitably or in a thread (:mod:`~kit.session.loop`), break points
(:mod:`~kit.session.breakpoints`), the session's world of RNG states and torch defaults
(:mod:`~kit.session.world`), interrupts held to the step boundary (:mod:`~kit.session.interrupts`),
the per-step history (:mod:`~kit.session.history`), the checkpoint browser
(:mod:`~kit.session.checkpoint_browser`) and dropping IPython's references
(:mod:`~kit.session.ipython_refs`).
"""

from kit.session.facade import Session, SessionInfo, UnknownSeqTagError
from kit.session.lifecycle import Status, StatusLine
from kit.session.result import TrainResult

Paused = TrainResult  # the old name of a paused call's result (every train call returns a TrainResult now)

__all__ = ["Paused", "Session", "SessionInfo", "Status", "StatusLine", "TrainResult", "UnknownSeqTagError"]
