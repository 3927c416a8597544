"""Static HTML summaries (no ipywidgets needed): what a Session shows when displayed."""

from __future__ import annotations

import html
from typing import Any


def session_html(session: Any) -> str:
    """Device, model size, position, learning rate, last scores and checkpoints of a Session."""
    engine = session.engine
    p = engine.progress
    plan = session.resume_plan  # before first use: where it will continue, not "epoch 1, step 0"
    position = plan or (f"epoch {p.epoch} of {engine.final_epoch}, step {p.step_in_epoch}, "
                        f"global step {p.global_train_step}, {p.num_updates} updates")
    rows = [("status", session.status), ("position", position)]
    if engine.model is not None:
        n = sum(t.numel() for t in engine.model.parameters())
        rows += [
            ("device", str(engine.device)),
            ("model", f"{type(engine.model).__name__}, {n:,} parameters"),
        ]
    else:
        rows.append(("model", "not built yet (built on first use)"))
    if engine.updater is not None:
        rows.append(("learning rate", f"{engine.updater.learning_rate:.6g}"))
    if engine.scores is not None and engine.scores.epochs:
        last = engine.scores.epochs[-1]
        scores = ", ".join(f"{k} {v:.4g}" for k, v in engine.scores.scores(last).items())
        rows.append((f"scores (epoch {last})", scores or "—"))
    prefix = session.config.typed_value("model")
    if prefix:
        from kit import checkpoints

        names = [c.name for c in checkpoints.list_checkpoints(prefix) if c.complete]
        rows.append(("checkpoints", f"{len(names)} ({', '.join(names[-3:])})" if names else "none yet"))
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
        f"{html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<div><b>kit.Session</b><table>{body}</table></div>"
