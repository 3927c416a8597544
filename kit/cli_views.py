"""What ``python -m kit scores`` / ``checkpoints`` print, and the closing summary of ``kit train``.

One number format everywhere (:func:`kit.scores.format_value`: 4 significant digits); tables are
plain text with aligned columns; ``*`` marks the best (lowest) value of each dev/eval score.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kit.errors import KitError
from kit.scores import format_lr, format_value, split_score_key

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.scores import ScoreTable

SCORE_SUFFIX = ".scores.json"


def run_in_folder(folder: str) -> tuple[str, str]:
    """(model prefix, score file) of the one run in ``folder`` (``runs/demo/`` → ``runs/demo/model``)."""
    names = sorted(os.listdir(folder))
    scores = [n for n in names if n.endswith(SCORE_SUFFIX)]
    if len(scores) == 1:
        prefix = os.path.join(folder, scores[0][: -len(SCORE_SUFFIX)])
        return prefix, prefix + SCORE_SUFFIX
    prefixes = sorted({n.split(".")[0] for n in names if n.endswith(".pt")})
    if not scores and len(prefixes) == 1:
        prefix = os.path.join(folder, prefixes[0])
        returnn_table = os.path.join(folder, "learning_rates")  # a RETURNN run's learning_rate_file, by its usual name
        return prefix, returnn_table if os.path.isfile(returnn_table) else prefix + SCORE_SUFFIX
    if not scores and not prefixes:
        raise KitError(f"{folder}: no score file (*{SCORE_SUFFIX}) and no checkpoints (*.pt) in this folder")
    found = ", ".join(scores or [p + ".*.pt" for p in prefixes])
    raise KitError(f"{folder}: several runs ({found}); name one, e.g. {os.path.join(folder, (scores or prefixes)[0])}")


def best_keys(keys: Sequence[str]) -> list[str]:
    """The score keys a best mark is shown for: those of datasets other than train (all when only train)."""
    held_out = [k for k in keys if split_score_key(k)[0] != "train"]
    return held_out or list(keys)


def main_score(table: ScoreTable) -> str | None:
    """The score a run is judged by: the first dev error rate, else the first dev/eval score."""
    keys = best_keys(sorted({k for e in table.epochs for k in table.scores(e)}))
    errors = [k for k in keys if k in table.error_keys]
    chosen = errors or keys
    return chosen[0] if chosen else None


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _best(values: Mapping[Any, float]) -> set[Any]:
    finite = {k: v for k, v in values.items() if v == v}
    if not finite:
        return set()
    low = min(finite.values())
    return {k for k, v in finite.items() if v == low}


def scores_text(table: ScoreTable, where: str) -> str:
    """The score file as a table: one line per epoch (learning rate, every score); ``*`` marks the best."""
    epochs = [e for e in table.epochs if table.scores(e)]
    if not epochs:
        return f"{where}: no epoch has scores yet"
    keys = sorted({k for e in epochs for k in table.scores(e)}, key=lambda k: (split_score_key(k)[0] != "train", k))
    marked = set(best_keys(keys))
    best = {k: _best({e: table.scores(e).get(k, float("nan")) for e in epochs}) for k in marked}
    rows = [["epoch", "lr", *keys]]
    for e in epochs:
        lr = table.learning_rate(e)
        row = [str(e), "-" if lr is None else format_lr(lr)]
        for k in keys:
            v = table.scores(e).get(k)
            text = "-" if v is None else format_value(float(v))
            row.append(text + ("*" if k in marked and e in best[k] else " " if k in marked else ""))
        rows.append(row)
    note = f"* best (lowest) of {', '.join(sorted(marked))}"
    return f"{where} ({len(epochs)} epochs)\n{_columns(rows)}\n{note}"


def checkpoints_text(found: list[Checkpoint], table: ScoreTable | None, prefix: str) -> str:
    """One line per checkpoint: kind, epoch, step, size, verification, its epoch's held-out scores, best marks."""
    from kit import checkpoints
    from kit.errors import CheckpointError

    if not found:
        return f"no checkpoints under {prefix!r}"
    scored = {c.epoch: table.scores(c.epoch) for c in found
              if table is not None and c.kind == "epoch" and c.epoch in table.epochs and table.scores(c.epoch)}
    keys = best_keys(sorted({k for row in scored.values() for k in row}))
    best = {k: _best({e: row.get(k, float("nan")) for e, row in scored.items()}) for k in keys}
    rows = [["name", "kind", "epoch", "step", "size", "verified", *keys]]
    total = 0
    for c in found:
        if not c.complete:
            state = "incomplete"
        else:
            try:
                checkpoints.verify(c, train_state=not c.weights_only)
                state = "ok, weights only" if c.weights_only else "ok"
            except CheckpointError as exc:
                state = "CORRUPT: " + str(exc).split(":")[-1].strip()[:40]
        total += c.size
        row = [c.name, c.kind, str(c.epoch), "-" if c.global_train_step is None else str(c.global_train_step),
               _size(c.size), state]
        for k in keys:
            v = scored.get(c.epoch, {}).get(k) if c.kind == "epoch" else None
            row.append("-" if v is None else format_value(float(v)) + ("*" if c.epoch in best[k] else " "))
        rows.append(row)
    lines = [f"{prefix}: {len(found)} checkpoints, {_size(total)}", _columns(rows)]
    if keys:
        lines.append(f"* best (lowest) of {', '.join(keys)}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def train_summary(table: ScoreTable, first_epoch: int, prefix: str | None, wall_secs: float) -> str:
    """The closing lines of ``kit train``: epochs trained, the best held-out score and its epoch, files, time."""
    epochs = [e for e in table.epochs if table.scores(e)]
    trained = [e for e in epochs if e >= first_epoch]
    lines = []
    if trained:
        span = f"epoch {trained[0]}" if len(trained) == 1 else f"epochs {trained[0]}-{trained[-1]}"
        lines.append(f"trained {span} ({len(trained)} this run, {len(epochs)} in all) in {_duration(wall_secs)}")
    else:
        lines.append(f"no epoch finished in this run ({_duration(wall_secs)})")
    key = main_score(table)
    if key is not None:
        values = {e: table.scores(e)[key] for e in epochs if key in table.scores(e)}
        best = min(values, key=lambda e: values[e]) if values else None
        if best is not None:
            lines.append(f"best {key} {format_value(float(values[best]))} at epoch {best}")
    if prefix:
        lines.append(f"files: {prefix}.*.pt (checkpoints), {table.path or prefix + SCORE_SUFFIX} (scores)")
    return "\n".join(lines)


def _duration(secs: float) -> str:
    if secs < 60:
        return f"{secs:.3g} s"
    minutes, s = divmod(int(round(secs)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m:02d} min" if hours else f"{m} min {s:02d} s"
