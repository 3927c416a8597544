"""``ScoreTable``: one row per epoch — learning rate, scores, meta — in an atomically written file.

>>> table = ScoreTable("runs/demo/model.scores.json")
>>> table.set_learning_rate(1, 1e-3)
>>> table.set_scores(1, {"train_loss_ce": 2.3, "dev_loss_ce": 2.1, "dev_loss_fer": 0.4}, errors={"dev_loss_fer"})
>>> table.save()
>>> table.to_pandas()  # doctest: +SKIP

The table is also the store of the learning-rate control: the lr of each epoch lives here,
so a restart continues the schedule (newbob included) from the file.

File format: JSON ``{"format": "kit-scores", "version": 1, "error_keys": [...], "epochs":
{"1": {"learning_rate": .., "scores": {..}, "meta": {..}}}}``. Non-finite numbers are written
as Python's json module writes them (``NaN``, ``Infinity``, ``-Infinity``) and read back
exactly; this is not strict JSON, but every JSON reader in Python, pandas and JavaScript's
JSON5 accept it. ``ScoreTable.load`` also reads RETURNN's learning-rate file
(``{1: EpochData(learningRate=.., error={..}), ...}``) — parsed with :mod:`ast`, never
evaluated; its keys are kept as they are. Saving always writes kit's JSON.

This module knows nothing of torch; pandas is imported only by :meth:`ScoreTable.to_pandas`.
"""

from __future__ import annotations

import copy
import errno
import html
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

from kit.errors import KitError, ScoreFileError
from kit.fileio import atomic_write_text, read_capped
from kit.score_parsing import FORMAT, VERSION, checked_state, parse_returnn_lr_file, parse_score_text

MAX_SCORE_FILE_BYTES = 256 << 20  # what kit reads of a score / learning-rate file

__all__ = ["FORMAT", "VERSION", "ScoreFileError", "ScoreTable", "format_epoch_summary", "format_lr",
           "format_step_line", "format_value", "parse_returnn_lr_file", "split_score_key"]


def _empty_row() -> dict[str, Any]:
    return {"learning_rate": None, "scores": {}, "meta": {}}


class ScoreTable:
    """Per-epoch learning rate, scores (``train_loss_ce``, ``dev_loss_fer``, ...) and meta."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path: str | None = os.fspath(path) if path is not None else None
        self._rows: dict[int, dict[str, Any]] = {}
        self._error_keys: set[str] = set()

    # ---- reading ------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, missing_ok: bool = False) -> ScoreTable:
        """Read a kit score file or a RETURNN learning-rate file (never executes anything).

        With ``missing_ok=True`` a missing file gives an empty table bound to ``path``.
        """
        path = os.fspath(path)
        table = cls(path)
        try:
            text = _read_text(path)
        except FileNotFoundError:
            if missing_ok:
                return table
            raise
        state = parse_score_text(text, path)
        del text
        table.set_checked_state(state)
        return table

    @property
    def epochs(self) -> list[int]:
        return sorted(self._rows)

    @property
    def error_keys(self) -> set[str]:
        """Score keys that are errors (marked ``as_error=True``), not differentiable losses."""
        return set(self._error_keys)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, epoch: object) -> bool:
        return epoch in self._rows

    def row(self, epoch: int) -> dict[str, Any]:
        """``{"learning_rate": .., "scores": {..}, "meta": {..}}`` (a copy). KeyError if absent."""
        if epoch not in self._rows:
            raise KeyError(f"no row for epoch {epoch} in the score table (epochs: {self.epochs})")
        return copy.deepcopy(self._rows[epoch])

    def learning_rate(self, epoch: int) -> float | None:
        row = self._rows.get(epoch)
        return None if row is None else row["learning_rate"]

    def scores(self, epoch: int) -> dict[str, float]:
        row = self._rows.get(epoch)
        return {} if row is None else dict(row["scores"])

    def meta(self, epoch: int) -> dict[str, Any]:
        row = self._rows.get(epoch)
        return {} if row is None else copy.deepcopy(row["meta"])

    def has_scores(self, epoch: int, prefix: str | None = None) -> bool:
        """Whether epoch has any score (whose key starts with ``prefix``, e.g. ``"dev_"``)."""
        keys = self.scores(epoch)
        return any(prefix is None or k.startswith(prefix) for k in keys)

    def best_epochs(self, key: str, n: int, lower_is_better: bool = True) -> list[int]:
        """The ``n`` best epochs by score ``key``, best first; epochs without it or with NaN are skipped."""
        values = [(v, e) for e in self.epochs if (v := self._rows[e]["scores"].get(key)) is not None]
        values = [(v, e) for v, e in values if not math.isnan(v)]
        values.sort(key=lambda ve: (ve[0] if lower_is_better else -ve[0], ve[1]))
        return [e for _, e in values[: max(n, 0)]]

    # ---- writing ------------------------------------------------------------------------

    def _row(self, epoch: int) -> dict[str, Any]:
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        return self._rows.setdefault(int(epoch), _empty_row())

    def set_learning_rate(self, epoch: int, lr: float | None) -> None:
        self._row(epoch)["learning_rate"] = None if lr is None else float(lr)

    def set_scores(self, epoch: int, scores: Mapping[str, float], *, errors: Iterable[str] = ()) -> None:
        """Add (or overwrite) scores of ``epoch``; ``errors`` names those keys that are errors."""
        errors = set(errors)
        unknown = errors - set(scores)
        if unknown:
            raise ValueError(
                f"set_scores: errors {sorted(unknown)} are not among the scores {sorted(scores)}"
            )
        values = {}
        for key, value in scores.items():
            if not isinstance(key, str):
                raise ValueError(f"set_scores: score keys must be strings, got {key!r}")
            values[key] = float(value)
        self._row(epoch)["scores"].update(values)
        self._error_keys.update(errors)

    def set_meta(self, epoch: int, **meta: Any) -> None:
        self._row(epoch)["meta"].update(meta)

    def remove_epochs_after(self, epoch: int) -> list[int]:
        """Forget every epoch > ``epoch`` (when rewinding to a checkpoint); returns the removed ones."""
        removed = [e for e in self.epochs if e > epoch]
        for e in removed:
            del self._rows[e]
        return removed

    def save(self, path: str | os.PathLike | None = None) -> str:
        """Write the table atomically (temp file + fsync + rename) as JSON; returns the path."""
        target = os.fspath(path) if path is not None else self.path
        if target is None:
            raise KitError("ScoreTable.save(): the table has no path; pass ScoreTable(path) or save(path)")
        atomic_write_text(target, self.to_json())
        return target

    def to_json(self) -> str:
        state = self.state_dict()
        state["epochs"] = {str(e): row for e, row in state["epochs"].items()}
        return json.dumps(state, indent=1, default=_json_default, allow_nan=True) + "\n"

    # ---- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "error_keys": sorted(self._error_keys),
            "epochs": {e: copy.deepcopy(self._rows[e]) for e in self.epochs},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the rows; a malformed ``state`` is a :class:`~kit.errors.ScoreFileError` naming the table's file."""
        self.set_checked_state(checked_state(state, self.path or "<state dict>"))

    def set_checked_state(self, state: Mapping[str, Any]) -> None:
        """Adopt the rows of a state that :func:`kit.score_parsing.checked_state` produced (not copied)."""
        rows = state["epochs"]
        for row in rows.values():
            for key, value in _empty_row().items():
                row.setdefault(key, value)
        self._rows = rows
        self._error_keys = set(state["error_keys"])

    # ---- views --------------------------------------------------------------------------

    def columns(self) -> list[str]:
        """``learning_rate``, then score keys, then meta keys (first-seen order over epochs)."""
        score_keys: dict[str, None] = {}
        meta_keys: dict[str, None] = {}
        for e in self.epochs:
            score_keys.update(dict.fromkeys(self._rows[e]["scores"]))
            meta_keys.update(dict.fromkeys(self._rows[e]["meta"]))
        taken = {"learning_rate", *score_keys}
        return ["learning_rate", *score_keys, *(_meta_column(k, taken) for k in meta_keys)]

    def records(self) -> list[dict[str, Any]]:
        """One flat dict per epoch (``epoch`` + the columns); meta keys clashing with scores get ``meta:``."""
        score_keys = {k for e in self.epochs for k in self._rows[e]["scores"]} | {"learning_rate"}
        out = []
        for e in self.epochs:
            row = self._rows[e]
            rec = {"epoch": e, "learning_rate": row["learning_rate"], **row["scores"]}
            rec.update({_meta_column(k, score_keys): v for k, v in row["meta"].items()})
            out.append(rec)
        return out

    def to_pandas(self, part: str = "all") -> Any:
        """A ``pandas.DataFrame`` indexed by ``epoch``, one column per lr / score / meta key.

        ``part``: ``"all"`` (every column, as the file), ``"scores"`` (learning rate and scores,
        what ``session.scores`` shows) or ``"meta"`` (the run's metadata: steps, times, host, versions).
        """
        import pandas as pd

        if part not in ("all", "scores", "meta"):
            raise ValueError(f"ScoreTable.to_pandas(part={part!r}): expected 'all', 'scores' or 'meta'")
        columns = self.columns()
        # a row that only holds the learning rate of an epoch not finished yet is not an epoch's row
        records = [r for r in self.records() if self._rows[r["epoch"]]["scores"] or self._rows[r["epoch"]]["meta"]]
        frame = pd.DataFrame.from_records(records, columns=["epoch", *columns]).set_index("epoch")
        if part == "all":
            return frame
        scores = ["learning_rate", *(k for k in columns if k in self._all_score_keys())]
        return frame[scores] if part == "scores" else frame[[c for c in columns if c not in scores]]

    def __repr__(self) -> str:
        where = f" {self.path}" if self.path else ""
        if not self._rows:
            return f"ScoreTable({where.strip() or 'no file'}, empty)"
        lines = [
            f"ScoreTable{where} ({len(self._rows)} epochs, errors: {', '.join(sorted(self._error_keys)) or '-'})"
        ]
        for e in self.epochs:
            row = self._rows[e]
            lr = "-" if row["learning_rate"] is None else format_lr(row["learning_rate"])
            scores = ", ".join(f"{k} {format_value(v)}" for k, v in row["scores"].items())
            lines.append(f"  ep {e}: lr {lr}" + (f", {scores}" if scores else ""))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        try:
            frame = self.to_pandas()
        except ImportError:
            return "<pre>" + html.escape(repr(self)) + "</pre>"
        score_cols = ["learning_rate", *(k for k in self.columns() if k in self._all_score_keys())]
        return frame[score_cols].to_html(
            float_format=lambda v: format_value(float(v)), formatters={"learning_rate": format_lr}
        )

    def _all_score_keys(self) -> set[str]:
        return {k for e in self.epochs for k in self._rows[e]["scores"]}


def _read_text(path: str) -> str:
    """The file's text; a FIFO, a folder or non-UTF-8 bytes give a ScoreFileError (never a blocking read)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, "score file not found", path)
    data = read_capped(path, MAX_SCORE_FILE_BYTES, f"score file '{path}'", ScoreFileError,
                       "a score table of 100,000 epochs with ten scores each is about 40 MB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ScoreFileError(f"score file '{path}', line {line}: not UTF-8 text (byte {data[e.start]:#04x} "
                             f"at offset {e.start})") from None


def _meta_column(key: str, taken: set[str]) -> str:
    return f"meta:{key}" if key in taken else key


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return repr(value)


# ---- log lines --------------------------------------------------------------------------


def format_value(v: Any) -> str:
    """kit's one number format (log lines, tables, CLI): 4 significant digits — ``0.5123``, ``0.0005106``,
    ``1.234e+04``, ``0`` (never ``0.000e+00``)."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_lr(lr: float) -> str:
    """A learning rate with 4 significant digits: ``0.001``, ``0.00015``, ``1e-05``."""
    return f"{lr:.4g}"


def format_step_line(
    epoch: int,
    step: int,
    losses: Mapping[str, float],
    secs_per_step: float | None = None,
    *,
    stage: str = "train",
    extra: Mapping[str, Any] | None = None,
) -> str:
    """``"ep 3 train, step 17, ce 0.5123, fer 0.12, 0.0812 sec/step"`` (RETURNN's per-step line)."""
    parts = [f"ep {epoch} {stage}", f"step {step}"]
    parts += [f"{k} {format_value(float(v))}" for k, v in losses.items()]
    parts += [f"{k} {format_value(v)}" for k, v in (extra or {}).items()]
    if secs_per_step is not None:
        parts.append(f"{secs_per_step:.4g} sec/step")
    return ", ".join(parts)


def split_score_key(key: str) -> tuple[str, str]:
    """``"dev_loss_ce"`` -> ``("dev", "ce")``; legacy ``"dev_score"`` -> ``("dev", "score")``."""
    if "_loss_" in key:
        dataset, name = key.split("_loss_", 1)
        return dataset, name
    dataset, _, name = key.partition("_")
    return dataset, name or key


def format_epoch_summary(
    epoch: int,
    scores: Mapping[str, float],
    *,
    error_keys: Iterable[str] = (),
    learning_rate: float | None = None,
    secs: float | None = None,
) -> str:
    """``"ep 3, lr 0.001, train: score ce 0.512 error fer 0.120, dev: score ce 0.601"``."""
    errors = set(error_keys)
    groups: dict[str, dict[str, list[str]]] = {}
    for key, value in scores.items():
        dataset, name = split_score_key(key)
        kind = "error" if key in errors else "score"
        groups.setdefault(dataset, {"score": [], "error": []})[kind].append(
            f"{name} {format_value(float(value))}"
        )
    parts = [f"ep {epoch}"]
    if learning_rate is not None:
        parts.append(f"lr {format_lr(float(learning_rate))}")
    for dataset, kinds in groups.items():
        text = " ".join(f"{kind} {' '.join(items)}" for kind, items in kinds.items() if items)
        parts.append(f"{dataset}: {text}")
    if secs is not None:
        parts.append(f"{secs:.1f} sec")
    return ", ".join(parts)
