"""``SessionParts``: what a :class:`kit.Session` is made of, as its own collaborators receive it.

The facade (:mod:`kit.session.facade`) keeps these private; the loop driver, the checkpoint
browser and the runs beside training (eval, forward, lr_find) are given this object, and views
get the facade's public API only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kit.config import Config
from kit.engine.engine import Engine
from kit.errors import SessionStateError
from kit.events import Events
from kit.session.breakpoints import Breakpoints
from kit.session.history import History
from kit.session.lifecycle import SessionState, Status
from kit.session.views import SessionViews
from kit.session.world import World

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint


@dataclass
class SessionParts:
    """The engine a session drives and the session's own state around it."""

    config: Config
    events: Events
    engine: Engine
    history: History
    views: SessionViews
    lifecycle: SessionState
    world: World
    breakpoints: Breakpoints

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """The session's RNG states and torch defaults in, the caller's back afterwards (:mod:`kit.session.world`)."""
        if self.lifecycle.status is Status.CLOSED:
            raise SessionStateError("this session is closed; create a new one")
        return self.world.entered()

    def setup(self) -> None:
        with self.entered():
            self.engine.setup()

    def prepare_training(self) -> None:
        with self.entered():
            self.engine.prepare_training()

    def model(self) -> torch.nn.Module:
        self.setup()
        model = self.engine.model
        assert model is not None
        return model

    # ---- the training state from checkpoints -----------------------------------------------

    def inspect(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        """``weights`` (of checkpoint ``name``) into the model for a look; training refuses until a restore."""
        self.lifecycle.inspect(self.model(), name, weights)

    def restore(self, ckpt: Checkpoint, loaded: tuple[dict, dict | None] | None = None) -> None:
        """Rewind the whole training state to ``ckpt`` (``loaded``: its files, already read and verified)."""
        self.prepare_training()
        with self.entered():
            self.engine.restore(ckpt, loaded)  # ``restored``: the history forgets the later steps
        self.lifecycle.consistent()

    def reload_latest(self) -> None:
        """Leave inspection: the training weights from before it, or (none in memory) the newest checkpoint."""
        from kit import checkpoints

        if not self.lifecycle.put_back_training_weights(self.model()):
            loaded = checkpoints.load_latest(self.config.typed_value("model") or "")
            if loaded is None:
                raise SessionStateError("no weights kept in memory and no complete checkpoint to reload")
            self.restore(loaded[0], loaded[1:])
        self.lifecycle.consistent()

    def cleanup_preview(self) -> list[Any]:
        """What ``cleanup_old_models`` would remove now."""
        self.setup()
        return self.engine.cleanup_preview()
