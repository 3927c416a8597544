"""``session.log_to(...)``: turn on a tracker (kit.loggers) for a notebook session."""

from __future__ import annotations

import logging
import os
from typing import Any

from kit.loggers import Tracker, make_tracker, tracker_params

logger = logging.getLogger("kit")


def log_to(config: Any, events: Any, global_step: Any, tracker: str | Tracker, options: dict[str, Any],
           *, task: str = "train") -> Tracker | None:
    """Attach ``tracker`` (a kind of :data:`kit.loggers.KINDS` built from ``options``, or a Tracker) to ``events``.

    Under torchrun (``RANK`` set) only rank 0 gets one unless ``options`` say ``all_ranks=True``: None elsewhere.
    """
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank and not options.get("all_ranks"):
        logger.info("log_to(%r): rank %d does not log (all_ranks=True asks every rank)", tracker, rank)
        return None
    if isinstance(tracker, Tracker):
        made = tracker
    else:
        model = config.typed_value("model")
        opts: Any = options
        if tracker == "csv" and not options:
            opts = True
        made = make_tracker(tracker, opts, model_prefix=f"{model}.rank{rank}" if rank and model else model,
                            task=task, config_file=config.source, params=tracker_params(config), rank=rank)
    return made.attach(events, global_step)
