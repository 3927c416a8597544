"""``kit.attach("runs/x/model")``: a notebook on a run that trains elsewhere (the CLI, torchrun, a cluster job).

It reads the run's event log (:mod:`kit.eventlog`, ``{model}.events.jsonl``) and score file as
they grow — on the same machine or over a shared file system — and asks the run to stop:
``.pause()`` / ``.stop()`` leave a request the run finds at its next step boundaries; it finishes
the step, writes a step checkpoint and exits as on SIGUSR1. Nothing here resumes a run: the next
``kit.Session.from_config(...)`` or ``python -m kit train`` continues it.

>>> run = kit.attach("runs/x/model")   # doctest: +SKIP
>>> run.scores                          # one row per finished epoch  # doctest: +SKIP
>>> run.history.tail()                  # the logged steps  # doctest: +SKIP
>>> run.pause(); run.wait()             # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import os
import time
from typing import Any

from kit.eventlog import REQUESTS, log_path, request_path, run_base

__all__ = ["Attached", "attach"]


def attach(model: str | os.PathLike) -> Attached:
    """A live view of the run that trains into checkpoint prefix ``model`` (its ``model`` config key)."""
    return Attached(os.fspath(model))


class Attached:
    """A run seen through its files: :attr:`events`, :attr:`history`, :attr:`scores`, :attr:`status`."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = ""
        self._asked_at = 0  # the events read when the last request was left (wait() looks after them)

    # ---- reading -----------------------------------------------------------------------------------

    def refresh(self) -> list[dict[str, Any]]:
        """Read what the run appended since the last read; returns the new events."""
        try:
            with open(log_path(run_base(self.prefix)), encoding="utf-8") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        if lines and lines[-1]:  # a line still being written: read it whole next time
            self._partial = lines[-1]
        new = [json.loads(line) for line in lines[:-1] if line.strip()]
        self.events.extend(new)
        return new

    @property
    def status(self) -> str:
        """``"not started"``, ``"running: epoch E, step S"``, ``"paused"``, ``"done"``, ``"failed: ..."``, ``"exited"``."""
        self.refresh()
        if not self.events:
            return "not started"
        last_run = max((i for i, e in enumerate(self.events) if e["event"] == "run_begin"), default=0)
        events = self.events[last_run:]
        ended = next((e for e in reversed(events) if e["event"] == "run_end"), None)
        if ended is not None:
            if ended["outcome"] == "failed":
                return f"failed: {ended.get('error')}"
            return ended["outcome"] + (f" ({ended['reason']})" if ended.get("reason") else "")
        if events[-1]["event"] == "exit":
            return "exited"
        step = next((e for e in reversed(events) if e["event"] == "step"), None)
        where = f": epoch {step['epoch']}, step {step['step']}" if step else ""
        return "running" + where

    @property
    def running(self) -> bool:
        return self.status.startswith("running")

    @property
    def history(self) -> Any:
        """pandas DataFrame of the logged steps (global step, epoch, step, learning rate, seconds, losses)."""
        import pandas as pd

        self.refresh()
        rows = [{"global_train_step": e["global_train_step"], "epoch": e["epoch"], "step": e["step"],
                 "learning_rate": e["learning_rate"], "seconds": e["seconds"], **e["losses"]}
                for e in self.events if e["event"] == "step"]
        return pd.DataFrame(rows)

    @property
    def scores(self) -> Any:
        """pandas DataFrame, one row per finished epoch (the run's score file; its log when there is none)."""
        from kit.config import Config
        from kit.engine.parts import score_file_path
        from kit.scores import ScoreTable

        path = score_file_path(Config({"model": self.prefix}))
        if path is not None and os.path.exists(path):
            return ScoreTable.load(path).to_pandas("scores")
        import pandas as pd

        self.refresh()
        rows = {e["epoch"]: e["scores"] for e in self.events if e["event"] == "epoch_end"}
        return pd.DataFrame.from_dict(rows, orient="index").rename_axis("epoch")

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoints the run wrote (names, oldest first; cleanup may have removed some since)."""
        self.refresh()
        return [e["name"] for e in self.events if e["event"] == "checkpoint"]

    # ---- asking ----------------------------------------------------------------------------------

    def pause(self) -> None:
        """Ask the run to finish its step, write a step checkpoint and exit (as SIGUSR1); resume it later."""
        self._request("pause")

    def stop(self) -> None:
        """Like :meth:`pause` (the log says "stop": not meant to be resumed)."""
        self._request("stop")

    def _request(self, what: str) -> None:
        assert what in REQUESTS
        self.refresh()
        self._asked_at = len(self.events)
        path = request_path(run_base(self.prefix))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(what + "\n")
        os.replace(tmp, path)  # whole or not at all: the run never reads half a request

    def wait(self, timeout: float | None = None, *, poll: float = 0.2) -> str:
        """Until the run's process has written its last line (its checkpoint too) — after the last request, when
        one was left; returns :attr:`status`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.refresh()
            if any(e["event"] == "exit" for e in self.events[self._asked_at:]):
                return self.status
            if deadline is not None and time.monotonic() > deadline:
                return self.status
            time.sleep(poll)

    # ---- showing ---------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<kit.attach {self.prefix!r}: {self.status}>"

    def _repr_html_(self) -> str:
        table = self.scores
        rows = table.to_html() if len(table) else "<i>no finished epoch yet</i>"
        return (f"<b>{html.escape(self.prefix)}</b>: {html.escape(self.status)}<br>{rows}")

    def widget(self, every: float = 2.0) -> Any:
        """An ipywidgets HTML view that re-reads the run every ``every`` seconds while it runs."""
        import threading

        import ipywidgets

        view = ipywidgets.HTML(self._repr_html_())

        def follow() -> None:
            while True:
                time.sleep(every)
                view.value = self._repr_html_()
                if not self.running:
                    return

        threading.Thread(target=follow, name="kit-attach-view", daemon=True).start()
        return view
