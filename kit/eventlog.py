"""A run's event log beside its checkpoints, and the requests a watcher leaves for it (:func:`kit.attach`).

``python -m kit train`` (and rank 0 under torchrun) appends one JSON object per line to
``{model}.events.jsonl``: ``run_begin``, ``epoch_begin``, ``step`` (every ``log_every_n_steps``
steps, with the losses the log line reads anyway), ``epoch_end`` (the score row), ``checkpoint``,
``run_end`` (``done`` / ``paused`` / ``failed``) and ``request`` (a watcher's pause or stop
arrived). Lines are only ever appended, each written whole and flushed, so a reader on the same
machine or a shared file system follows the run as it trains.

In RETURNN's layout (config key ``run_files``) both files live outside the run directory, in kit's
state directory (:func:`outside_base`); :func:`kit.attach` finds them there.

A watcher asks the run to stop by writing ``{model}.request`` (``pause`` or ``stop``). The run looks
for it at step boundaries — one ``os.stat`` at most every ``POLL_SECS`` (rank 0; under torchrun
rank 0 tells the others every ``DIST_POLL_STEPS`` steps with one all-reduce, so every rank stops
at the same step) — then finishes the step, writes a step checkpoint and exits as on SIGUSR1.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from kit.events import Event, Events

POLL_SECS = 0.5
DIST_POLL_STEPS = 20
LOG_SUFFIX = ".events.jsonl"
REQUEST_SUFFIX = ".request"
REQUESTS = ("pause", "stop")
WAIT_FOR_A_STEP = ("run_begin", "epoch_begin")  # written once the run has trained a step


def log_path(prefix: str) -> str:
    return os.fspath(prefix) + LOG_SUFFIX


def request_path(prefix: str) -> str:
    return os.fspath(prefix) + REQUEST_SUFFIX


def state_dir() -> str:
    """kit's per-user state directory: ``$KIT_STATE_DIR``, else ``$XDG_STATE_HOME/kit``, else ``~/.local/state/kit``."""
    if os.environ.get("KIT_STATE_DIR"):
        return os.environ["KIT_STATE_DIR"]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "kit")


def outside_base(prefix: str) -> str:
    """Where a run in RETURNN's layout (config key ``run_files``) keeps its event log and requests, so that its
    run directory holds only RETURNN's files: one folder per run in :func:`state_dir`, named by the prefix's
    absolute path (its base name and a digest)."""
    absolute = os.path.abspath(os.fspath(prefix))
    name = os.path.basename(absolute)
    digest = hashlib.sha256(absolute.encode()).hexdigest()[:16]
    return os.path.join(state_dir(), "runs", f"{name}-{digest}", name)


def run_base(prefix: str) -> str:
    """Where the run of ``prefix`` keeps its log: beside its checkpoints, or (RETURNN's layout) outside them."""
    prefix = os.fspath(prefix)
    outside = outside_base(prefix)
    if not os.path.exists(log_path(prefix)) and os.path.exists(log_path(outside)):
        return outside
    return prefix


class EventLog:
    """The bus subscriber that writes the log and polls for requests; ``request(reason)`` stops the run."""

    def __init__(self, prefix: str, *, log_every: int, request: Callable[[str], None], main: bool = True,
                 distributed: bool = False, base: str | None = None):
        self.prefix, self.log_every, self.request, self.main = prefix, max(1, log_every), request, main
        self.distributed = distributed
        self.base = base or prefix  # the log and requests: {base}.events.jsonl, {base}.request
        # a watcher that came before the run's first line leaves its request beside the checkpoints
        self.request_paths = list(dict.fromkeys([request_path(self.base), request_path(prefix)]))
        # opened at the run's first step (a run that fails before one, e.g. on a config or data error, leaves
        # no file); the lines before it wait in ``pending``
        self.file: Any = None
        self.pending: list[str] = []
        self.polled_at = 0.0
        self.requested: str | None = None
        if main:
            for path in self.request_paths:  # a request left from an earlier run is not this run's
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def subscribe(self, events: Events) -> None:
        events.on(Event.RUN_BEGIN, self.on_run_begin)
        events.on(Event.EPOCH_BEGIN, self.on_epoch_begin)
        events.on(Event.STEP_END, self.on_step_end)
        events.on(Event.EPOCH_END, self.on_epoch_end)
        events.on(Event.CHECKPOINT_SAVED, self.on_checkpoint)
        events.on(Event.RUN_END, self.on_run_end)

    def write(self, event: str, **fields: Any) -> None:
        if not self.main:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}, default=str) + "\n"
        if self.file is None:
            if event in WAIT_FOR_A_STEP:
                self.pending.append(line)
                return
            if event in ("run_end", "exit"):  # the run trained nothing: no log
                return
            os.makedirs(os.path.dirname(os.path.abspath(self.base)), exist_ok=True)
            self.file = open(log_path(self.base), "a", encoding="utf-8")  # noqa: SIM115 - kept open
            self.file.write("".join(self.pending))
            self.pending.clear()
        self.file.write(line)
        self.file.flush()

    # ---- the bus -----------------------------------------------------------------------------------

    def on_run_begin(self, goal: str) -> None:
        self.write("run_begin", goal=goal, pid=os.getpid(), host=socket.gethostname())

    def on_epoch_begin(self, epoch: int, learning_rate: float) -> None:
        self.write("epoch_begin", epoch=epoch, learning_rate=learning_rate)

    def on_step_end(self, result: Any) -> None:
        step = result.global_train_step
        if self.main and (self.file is None or result.step % self.log_every == 0):  # the first step opens the log
            self.write("step", epoch=result.epoch, step=result.step, global_train_step=step,
                       learning_rate=result.learning_rate, seconds=round(result.seconds, 6), losses=result.losses)
        if self.requested is None:
            self.poll(step)

    def on_epoch_end(self, epoch: int, scores: dict[str, Any]) -> None:
        self.write("epoch_end", epoch=epoch, scores=scores)

    def on_checkpoint(self, checkpoint: Any) -> None:
        self.write("checkpoint", name=checkpoint.name, path=checkpoint.path, kind=checkpoint.kind,
                   epoch=checkpoint.epoch, global_train_step=checkpoint.global_train_step)

    def on_run_end(self, outcome: str, error: BaseException | None) -> None:
        self.write("run_end", outcome=outcome, error=None if error is None else f"{type(error).__name__}: {error}",
                   reason=self.requested)

    # ---- requests ------------------------------------------------------------------------------------

    def poll(self, step: int) -> None:
        """Look for a watcher's request (cheaply: see the module docstring); found → stop at this boundary."""
        if self.distributed:
            if step % DIST_POLL_STEPS:
                return
            import torch
            import torch.distributed as dist

            flag = torch.tensor([REQUESTS.index(r) + 1 if (r := self.read_request()) else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # rank 0's word (the others read nothing)
            found = REQUESTS[int(flag.item()) - 1] if int(flag.item()) else None
        else:
            now = time.monotonic()
            if now - self.polled_at < POLL_SECS:
                return
            self.polled_at = now
            found = self.read_request()
        if found is not None:
            self.requested = found
            self.write("request", request=found, global_train_step=step)
            self.request(f"attach: {found}")

    def read_request(self) -> str | None:
        if not self.main:
            return None
        for path in self.request_paths:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
            except (FileNotFoundError, IsADirectoryError):
                continue
            os.remove(path)
            return text if text in REQUESTS else "stop"
        return None

    def close(self) -> None:
        """The last line ("exit": the process is done with the run, its checkpoint written)."""
        self.write("exit", pid=os.getpid())
        if self.file is not None:
            self.file.close()
            self.file = None


def attach_to(engine: Any, request: Callable[[str], None]) -> EventLog | None:
    """The CLI's event log on ``engine``'s bus (rank 0 writes; every rank polls with it); None without ``model``
    or under ``dry_run``."""
    if not engine.writes_files:  # no 'model', or RETURNN's dry_run
        return None
    from kit.compat.run_files import returnn_layout

    prefix = engine.model_prefix
    config = engine.config
    dist = engine.dist
    log = EventLog(prefix, log_every=config.int("log_every_n_steps"), request=request,
                   main=dist is None or dist.is_main, distributed=dist is not None,
                   base=outside_base(prefix) if returnn_layout(config) else prefix)
    log.subscribe(engine.events)
    return log
