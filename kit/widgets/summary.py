"""Static HTML summaries (no ipywidgets needed): what a Session shows when displayed."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kit.session.facade import Session


def session_html(session: Session) -> str:
    """Device, model size, position, learning rate, last scores and checkpoints of a Session."""
    info = session.info()
    p = info.progress
    plan = info.resume_plan  # before first use: where it will continue, not "epoch 1, step 0"
    position = plan or (f"epoch {p.epoch} of {info.final_epoch}, step {p.step_in_epoch}, "
                        f"global step {p.global_train_step}, {p.num_updates} updates")
    rows = [("status", info.status), ("position", position)]
    if info.num_parameters is not None:
        rows += [
            ("device", str(info.device)),
            ("model", f"{info.model_class}, {info.num_parameters:,} parameters"),
        ]
    else:
        rows.append(("model", "not built yet (built on first use)"))
    lr = info.learning_rate
    if lr is not None:
        rows.append(("learning rate", f"{lr:.6g}"))
    table = info.score_table
    if table is not None and table.epochs:
        last = table.epochs[-1]
        scores = ", ".join(f"{k} {v:.4g}" for k, v in table.scores(last).items())
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
