"""``session.checkpoints.widget()``: pick a checkpoint by looking at it.

A list of the checkpoints with their scores (incomplete and corrupt files marked as such);
selecting one shows its scores, parameter statistics and the difference to the current
model; buttons load it for inspection, restore the training state from it (after a
confirmation: it rewinds the whole run), export its weights as safetensors, or delete it
(after a confirmation). It refreshes itself when the session saves a checkpoint (and after the
cleanup at an epoch's end); Refresh reads the files again at any time. After every action the list, the details and the difference to the
current model are read again, and the message line shows that action's outcome only.
Incomplete or corrupt checkpoints cannot be loaded, restored or exported.
"""

from __future__ import annotations

import contextlib
import html
import io
import logging
import math
import threading
import time
from typing import Any

from kit.events import Event
from kit.widgets.dashboard import default_mode

logger = logging.getLogger("kit")
REFRESH_DELAY_SECS = 0.2  # after a checkpoint event: the epoch end's cleanup comes right after the save

WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
MAX_PARAM_ROWS = 40


def _state(row: dict[str, Any]) -> str:
    if not row["complete"]:
        return "incomplete"
    return "ok" if row["verified"] else "corrupt"


def _score_keys(columns: list[str]) -> list[str]:
    keys = [
        c
        for c in columns
        if not c.startswith("is_best_") and ("_loss_" in c or "_error_" in c or c.endswith("_score"))
    ]
    return sorted(keys, key=lambda k: (not k.startswith("dev"), k))


class CheckpointWidget:
    """The checkpoint table of a :class:`kit.session.checkpoint_browser.CheckpointBrowser` as a widget."""

    def __init__(self, browser: Any, *, mode: str | None = None, session: Any = None):
        self.browser = browser
        self.mode = "text" if (mode or default_mode()) == "text" else "widget"
        self.rows: list[dict[str, Any]] = []
        self.pending: str | None = None  # the action ("restore" / "delete") waiting for its confirmation
        self.score_keys: list[str] = []
        self.selected: str | None = None
        self.best: str | None = None  # the usable checkpoint with the lowest first score (dev first)
        self.widget: Any = None
        if self.mode == "widget":
            self._build()
        self.refresh()
        self._pending_refresh: threading.Timer | None = None
        self._session = session
        if session is not None:  # a new checkpoint (and the cleanup after an epoch's) shows up by itself
            for event in (Event.CHECKPOINT_SAVED, Event.EPOCH_END):
                session.on(event, self._on_files_changed)

    def _on_files_changed(self, **_: Any) -> None:
        """Re-read the files soon, off the training thread (verifying a new checkpoint hashes its files); events
        close together (a save, then the epoch end's cleanup) make one refresh after the last of them."""
        if self._pending_refresh is not None:
            self._pending_refresh.cancel()  # not started yet: the new one replaces it
        self._pending_refresh = threading.Timer(REFRESH_DELAY_SECS, self._refresh_quietly)
        self._pending_refresh.daemon = True
        self._pending_refresh.start()

    def _refresh_quietly(self) -> None:
        from kit.session.lifecycle import Status

        kind = self._session.status.kind
        if kind is Status.CLOSED:
            return
        if kind is Status.RUNNING:  # still training (the next epoch): read the files when it stops
            self._on_files_changed()
            return
        try:
            self.refresh()
        except Exception as exc:  # a timer thread: say it, never raise
            logger.warning("checkpoint widget: refreshing after a new checkpoint failed: %s: %s",
                           type(exc).__name__, exc)

    def wait_for_refresh(self, timeout: float = 30.0) -> None:
        """Block until a refresh started by an event has run (for scripts and tests)."""
        deadline = time.monotonic() + timeout
        while (timer := self._pending_refresh) is not None and time.monotonic() < deadline:
            timer.join(max(0.0, deadline - time.monotonic()))
            if timer is self._pending_refresh:
                break

    # ---- the widget -------------------------------------------------------------------

    def _build(self) -> None:
        import ipywidgets as w

        self.header = w.HTML()
        self.select = w.Select(options=[], rows=8, layout=w.Layout(width="100%"))
        self.select.add_class("kit-ckpt-select")
        self.select.observe(lambda change: self._safely(self._show, change["new"]), names="value")
        self.details = w.HTML()
        self.message = w.HTML()
        self.buttons = {
            name: w.Button(description=label, icon=icon, layout=w.Layout(width="auto"))
            for name, label, icon in [
                ("load", "Load for inspection", "eye"),
                ("restore", "Restore training state", "undo"),
                ("export", "Export safetensors", "download"),
                ("delete", "Delete…", "trash"),
                ("refresh", "Refresh", "refresh"),
            ]
        }
        self.buttons["delete"].button_style = "warning"
        for name, button in self.buttons.items():
            button.on_click(lambda _b, name=name: self._safely(getattr(self, f"_on_{name}")))
        self.confirm_text = w.HTML()
        self.confirm_yes = w.Button(description="Yes, delete", button_style="danger")
        self.confirm_no = w.Button(description="Cancel")
        self.confirm_yes.on_click(lambda _b: self._safely(self._on_confirm))
        self.confirm_no.on_click(lambda _b: self._safely(self._hide_confirm))
        self.confirm = w.HBox(
            [self.confirm_text, self.confirm_yes, self.confirm_no], layout=w.Layout(display="none")
        )
        style = w.HTML(
            "<style>.kit-ckpt-select select, .kit-ckpt-header {font-family: monospace;"
            " white-space: pre}</style>"
        )
        self.widget = w.VBox(
            [
                style,
                self.header,
                self.select,
                w.HBox(list(self.buttons.values())),
                self.confirm,
                self.message,
                self.details,
            ]
        )
        self.widget.add_class("kit-checkpoints")

    def _safely(self, fn: Any, *args: Any) -> None:
        """Run a button action; its error (and what it printed) goes to the message line, which
        first forgets the previous action's message."""
        if self.mode == "widget":
            self.message.value = ""
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                fn(*args)
        except Exception as exc:
            self._say(f"{type(exc).__name__}: {exc}", error=True)
            return
        if out.getvalue().strip() and self.mode == "widget" and not self.message.value:
            self._say(out.getvalue().strip())

    def _say(self, text: str, *, error: bool = False) -> None:
        if self.mode == "widget":
            color = "#b00" if error else "#060"
            self.message.value = f"<span style='color:{color}'>{html.escape(text)}</span>"

    # ---- listing ------------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the checkpoint files again."""
        frame = self.browser.table_all
        self.rows = frame.to_dict("records") if len(frame) else []
        self.score_keys = _score_keys(list(frame.columns))
        usable = [
            r
            for r in self.rows
            if _state(r) == "ok" and self.score_keys and _number(r.get(self.score_keys[0]))
        ]
        self.best = min(usable, key=lambda r: r[self.score_keys[0]])["name"] if usable else None
        if self.mode != "widget":
            return
        self.header.value = f"<div class='kit-ckpt-header'>{html.escape(self._line(None))}</div>"
        keep = self.selected if any(r["name"] == self.selected for r in self.rows) else None
        self.select.options = [(self._line(r), r["name"]) for r in self.rows]
        self.select.rows = min(12, max(3, len(self.rows)))
        self.select.value = keep
        self._show(keep)

    def _line(self, row: dict[str, Any] | None) -> str:
        keys = self.score_keys[:4]
        if row is None:
            return f"{'checkpoint':<22} {'state':<10} {'epoch':>5} {'step':>7} " + " ".join(
                f"{k:>14}" for k in keys
            )
        scores = " ".join(f"{_fmt(row.get(k)):>14}" for k in keys)
        best = f" ★ best {keys[0]}" if row["name"] == self.best else ""
        return (
            f"{row['name']:<22} {_state(row):<10} {_int(row['epoch']):>5} {_int(row['global_train_step']):>7} "
            f"{scores}{best}"
        )

    def text(self) -> str:
        """The table as text: name, state, epoch, step and scores (no times or paths)."""
        if not self.rows:
            return f"no checkpoints under model={self.browser.prefix!r}"
        return "\n".join([self._line(None).rstrip(), *(self._line(r).rstrip() for r in self.rows)])

    def row(self, name: str) -> dict[str, Any]:
        for row in self.rows:
            if row["name"] == name:
                return row
        raise KeyError(
            f"no checkpoint {name!r} in the table (have: {', '.join(r['name'] for r in self.rows)})"
        )

    # ---- selection ----------------------------------------------------------------------

    def select_checkpoint(self, name: str | None) -> None:
        """Select like a click in the list (shows details, enables the buttons that apply)."""
        if self.mode == "widget":
            self.select.value = name
        else:
            self.selected = name

    def _show(self, name: str | None) -> None:
        self.selected = name
        self.message.value = ""
        self._hide_confirm()
        usable = name is not None and _state(self.row(name)) == "ok"
        for key in ("load", "restore", "export"):
            self.buttons[key].disabled = not usable
        self.buttons["delete"].disabled = name is None
        if name is None:
            self.details.value = "<i>select a checkpoint</i>" if self.rows else "<i>no checkpoints yet</i>"
            return
        self.details.value = self.details_html(name)

    def details_html(self, name: str) -> str:
        """Scores, parameter statistics and difference to the current model of one checkpoint."""
        row = self.row(name)
        state = _state(row)
        parts = [
            f"<b>{html.escape(name)}</b> — {html.escape(row['kind'])} checkpoint, epoch {row['epoch']}, "
            f"global step {row['global_train_step']}, {row['size_mb']} MB, {html.escape(str(row['time']))}"
        ]
        if state != "ok":
            why = (
                "no manifest: the save did not finish"
                if state == "incomplete"
                else "its files do not match the manifest"
            )
            return parts[0] + f"<br><b style='color:#b00'>{state} ({why}): it cannot be loaded</b>"
        scores = {k: row[k] for k in self.score_keys if _number(row.get(k))}
        if scores:
            parts.append(
                "<b>scores</b>: " + ", ".join(f"{html.escape(k)} {_fmt(v)}" for k, v in scores.items())
            )
        parts.append(self._parameter_table(name))
        return "<br>".join(parts)

    def _parameter_table(self, name: str) -> str:
        weights = self.browser.weights(name)
        try:
            current = self.browser.weights("current")
        except Exception as exc:  # no model (e.g. get_model fails): statistics without the difference
            current, note = {}, f"difference to the current model unavailable: {type(exc).__name__}: {exc}"
        else:
            note = ""
        stats = parameter_stats(weights, current)
        total_diff = math.sqrt(sum(s["diff"] ** 2 for s in stats if s["diff"] is not None))
        total_norm = math.sqrt(sum(s["norm"] ** 2 for s in stats))
        head = (
            f"<b>parameters</b>: {len(stats)} tensors, {sum(s['numel'] for s in stats):,} values, L2 norm "
            f"{total_norm:.4g}; L2 difference to the current model {total_diff:.4g}"
        )
        cells = "".join(
            f"<tr><td>{html.escape(s['name'])}</td><td>{s['shape']}</td><td>{s['mean']:.3g}</td><td>{s['std']:.3g}</td>"
            f"<td>{s['norm']:.4g}</td><td>{_fmt(s['diff'])}</td><td>{_fmt(s['rel'])}</td></tr>"
            for s in stats[:MAX_PARAM_ROWS]
        )
        more = f"<i>… {len(stats) - MAX_PARAM_ROWS} more tensors</i>" if len(stats) > MAX_PARAM_ROWS else ""
        table = (
            "<table><tr><th>parameter</th><th>shape</th><th>mean</th><th>std</th><th>norm</th>"
            f"<th>L2 diff to current</th><th>relative change</th></tr>{cells}</table>"
        )
        return head + (f"<br><i>{html.escape(note)}</i>" if note else "") + table + more

    # ---- actions ------------------------------------------------------------------------

    def _require_selection(self) -> str:
        if self.selected is None:
            raise ValueError("select a checkpoint first")
        return self.selected

    def _on_load(self) -> None:
        ckpt = self.browser.load(self._require_selection())
        self.refresh()  # the current model changed: the differences too
        self._say(
            f"loaded the weights of {ckpt.name} for inspection (training state untouched); "
            "Restore continues training from a checkpoint, session.checkpoints.reload_latest() goes back"
        )

    def _on_restore(self) -> None:
        name = self._require_selection()
        self._ask("restore", f"Restore the training state of <b>{html.escape(name)}</b>? Weights, optimizer, "
                  "position, RNG and the score table go back to that checkpoint; later scores are dropped.")

    def _restore(self, name: str) -> None:
        ckpt = self.browser.restore(name)
        self.refresh()
        self._say(f"restored the training state of {ckpt.name}: the next train_* call continues from there")

    def _on_export(self) -> None:
        path = self.browser.export_safetensors(self._require_selection())
        self.refresh()
        self._say(f"wrote {path}")

    def _on_delete(self) -> None:
        name = self._require_selection()
        self._ask("delete", f"Delete <b>{html.escape(name)}</b> and its files? This cannot be undone.")

    def _ask(self, action: str, question: str) -> None:
        self.pending = action
        self.confirm_text.value = question
        self.confirm_yes.description = f"Yes, {action}"
        self.confirm.layout.display = "flex"

    def _hide_confirm(self) -> None:
        self.pending = None
        if self.mode == "widget":
            self.confirm.layout.display = "none"

    def _on_confirm(self) -> None:
        name, action = self._require_selection(), self.pending
        self._hide_confirm()
        if action == "restore":
            self._restore(name)
        elif action == "delete":
            self._delete(name)

    def _delete(self, name: str) -> None:
        try:
            self.browser.delete(name)
        finally:  # also when it was refused: the list and details as they are now
            self.refresh()
        self._say(f"deleted {name}")

    def _on_refresh(self) -> None:
        self.refresh()

    # ---- display ------------------------------------------------------------------------

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle = {"text/plain": self.text()}
        if self.mode == "widget":
            bundle[WIDGET_VIEW_MIME] = self.widget._repr_mimebundle_()[WIDGET_VIEW_MIME]
            bundle["text/html"] = f"<pre>{html.escape(self.text())}</pre>"
        return bundle

    def __repr__(self) -> str:
        return self.text()


def parameter_stats(weights: dict[str, Any], current: dict[str, Any]) -> list[dict[str, Any]]:
    """Per floating-point tensor: shape, mean, std, norm, and L2 / relative difference to ``current``."""
    import torch

    stats = []
    for name, tensor in weights.items():
        if not torch.is_tensor(tensor) or not torch.is_floating_point(tensor):
            continue
        t = tensor.detach().to("cpu", torch.float64)
        norm = t.norm().item()
        diff = rel = None
        other = current.get(name)
        if torch.is_tensor(other) and other.shape == t.shape:
            diff = (other.detach().to("cpu", torch.float64) - t).norm().item()
            rel = diff / norm if norm > 0 else (math.inf if diff else 0.0)
        stats.append(
            {
                "name": name,
                "shape": tuple(t.shape),
                "numel": t.numel(),
                "mean": t.mean().item() if t.numel() else 0.0,
                "std": t.std().item() if t.numel() > 1 else 0.0,
                "norm": norm,
                "diff": diff,
                "rel": rel,
            }
        )
    return stats


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> str:
    return str(int(v)) if _number(v) else "-"


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if _number(v) else "-"
