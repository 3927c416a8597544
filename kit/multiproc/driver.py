"""A Session's train calls on N worker processes (``session.train(processes=N)``), the kernel's side.

The session's own engine stays the home of the training state: each call sends it to the workers
only when it changed since they had it (a new config, a restore, steps trained in the kernel, another
process count); the workers step the engine's loop as torchrun's ranks do; the kernel re-emits rank
0's events on the session's bus as they come (the dashboard, ``session.history`` and
``session.scores`` fill as if the session trained alone), asks every rank to stop at the same step
boundary on Pause or Ctrl-C, and when the call ends restores rank 0's state into its engine — so
the next call may run in the kernel or on workers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kit.engine.debugging import DebugContext
from kit.errors import SessionStateError
from kit.events import PAYLOADS, Event, StepEnd
from kit.multiproc import wire
from kit.multiproc.pool import WorkerPool
from kit.session.lifecycle import Status

if TYPE_CHECKING:
    from kit.engine.loop import RunOutcome
    from kit.session.loop import LoopDriver
    from kit.session.parts import SessionParts
    from kit.session.result import TrainResult

POLL_SECS = 0.05


class Processes:
    """One session's worker processes and what they hold of its state."""

    def __init__(self, parts: SessionParts, driver: LoopDriver):
        self.parts, self.driver = parts, driver
        self.pool: WorkerPool | None = None
        self.config_version: int | None = None  # the config the workers hold
        self.synced: tuple[Any, ...] | None = None  # the kernel's state as the workers hold it
        self.changes = 0  # kernel steps and restores (the workers' state is stale after one)
        self.relaying = False
        self.ranks: dict[int, wire.RankStatus] = {}
        self.last_size = 1  # the process count of the last call (a paused epoch continues with it)
        for event in (Event.STEP_END, Event.RESTORED):
            parts.events.on(event, self.on_kernel_change)

    def on_kernel_change(self, **_: Any) -> None:
        if not self.relaying:
            self.changes += 1

    # ---- which count, which pool -----------------------------------------------------------------

    def size(self, processes: int | None) -> int:
        """``processes`` checked; None: the count the running epoch was trained with (else 1)."""
        if processes is None:
            running = self.parts.engine.progress.epoch_running
            return self.last_size if running and self.synced is not None and self.synced == self.marker() else 1
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes must be an int >= 1, got {processes!r}")
        return processes

    def marker(self) -> tuple[Any, ...]:
        engine = self.parts.engine
        return (id(self.pool), self.parts.config.version, self.changes, str(engine.progress.state_dict()))

    def ensure_pool(self, size: int) -> WorkerPool:
        engine = self.parts.engine
        if self.pool is not None and (self.pool.size != size or not self.pool.alive):
            self.close()
        if self.pool is None:
            import torch

            device = engine.device
            cuda = device is not None and device.type == "cuda"
            if cuda and torch.cuda.device_count() < size:
                raise SessionStateError(f"processes={size} on CUDA needs {size} devices, this machine has "
                                        f"{torch.cuda.device_count()}")
            threads = 0 if cuda else max(1, torch.get_num_threads() // size)
            self.pool = WorkerPool(size, backend="cpu:gloo,cuda:nccl" if cuda else "gloo", threads=threads)
            self.config_version = self.synced = None
        return self.pool

    def close(self, *, force: bool = False) -> None:
        if self.pool is not None:
            self.pool.close(force=force)
        self.pool = None
        self.config_version = self.synced = None
        self.ranks = {}

    # ---- a call ------------------------------------------------------------------------------------

    def start(self, goal: str, n: int, size: int) -> Call:
        """Send the call to the workers (the config and state when they changed); the lock goes with it."""
        engine, config = self.parts.engine, self.parts.config
        pool = self.ensure_pool(size)
        send_config = self.config_version != config.version
        send_state = send_config or self.synced != self.marker()
        with self.relayed():
            state = wire.state_bytes(engine.capture(), 1) if send_state else None
        payload = wire.dumps({"config": wire.dumps(config) if send_config else None, "state": state,
                              "goal": goal, "n": n, "final_epoch": engine.final_epoch})
        self.config_version, self.synced, self.last_size = config.version, None, size
        engine.release_prefix_lock()  # rank 0 writes the checkpoints meanwhile
        pool.send(payload)
        return Call(self, pool, goal, n)

    @contextlib.contextmanager
    def relayed(self) -> Iterator[None]:
        was, self.relaying = self.relaying, True
        try:
            yield
        finally:
            self.relaying = was


class Call:
    """One call on the workers: relay their messages until every rank is done (or one failed)."""

    def __init__(self, owner: Processes, pool: WorkerPool, goal: str, n: int):
        self.owner, self.pool, self.goal, self.n = owner, pool, goal, n
        self.done: dict[int, dict[str, Any]] = {}
        self.ended = False
        self.stop_sent = False

    def poll(self, timeout: float) -> bool:
        """Handle what arrived (waiting up to ``timeout``); True once every rank is done."""
        guard = self.owner.driver.guard
        if guard.requested and not self.stop_sent:
            self.pool.request_stop()
            self.stop_sent = True
        for message in self.pool.messages(timeout):
            kind, rank, body = message
            if kind == "events":
                self.relay(wire.loads(body))
            elif kind == "status":
                self.owner.ranks[rank] = body
            elif kind == "done":
                self.done[rank] = body
            elif kind == "error":
                self.fail(wire.loads(body))
        return len(self.done) == self.pool.size

    def relay(self, items: list[tuple[Any, ...]]) -> None:
        """Rank 0's events on the session's bus, as if the session had trained them."""
        parts = self.owner.parts
        with self.owner.relayed():
            for item in items:
                if item[0] == "scores":
                    table = parts.engine.scores
                    if table is not None:
                        table.load_state_dict(item[1])
                    continue
                _, name, payload = item
                if name == "step_end":
                    parts.events.emit(StepEnd(payload["result"]))
                    continue
                parts.events.emit(PAYLOADS[Event(name)](**payload))
                if name == "epoch_end":
                    parts.history.epoch_ended()

    def finish(self, outcome: RunOutcome) -> TrainResult:
        """Rank 0's state into the session's engine, and the call's result."""
        owner = self.owner
        parts, driver = owner.parts, owner.driver
        self.close_call()
        reply = self.done[0]
        ranks_at = {body["global_train_step"] for body in self.done.values()}
        if len(ranks_at) != 1:  # never expected: the ranks agree on every stop
            owner.close(force=True)
            raise SessionStateError(f"the worker processes stopped at different steps ({sorted(ranks_at)})")
        restore(parts, reply["state"])
        owner.synced = owner.marker()
        kind = reply["outcome"]
        if kind == "finished":
            parts.lifecycle.set(Status.FINISHED)
        if kind == "paused":
            driver.steps_left = max(self.n - reply["steps"], 0)
        return driver.finish(self.goal, (kind, reply["last"], None), outcome)

    def close_call(self) -> None:
        if not self.ended:
            self.ended = True
            self.owner.parts.engine.take_prefix_lock()

    def abandon(self) -> None:
        """The call ends without its result (a forced interrupt, an error here): the workers are stopped."""
        if not self.ended:
            self.owner.close(force=True)
            self.close_call()

    def fail(self, failure: wire.Failure) -> None:
        """A worker's error as the session's: its state and step context home, the workers stopped."""
        owner = self.owner
        parts = owner.parts
        owner.close(force=True)  # the other ranks wait in a collective that never comes
        self.close_call()
        if failure.state is not None:
            restore(parts, failure.state)
        error: BaseException | None = None
        if failure.exception is not None:
            with contextlib.suppress(Exception):
                error = wire.loads(failure.exception)
        if not isinstance(error, BaseException):
            error = wire.WorkerError(f"worker rank {failure.rank} failed: {failure.type_name}: {failure.message}")
        if failure.context is not None:
            engine = parts.engine
            parts.breakpoints.last_failure = DebugContext(**failure.context, model=engine.model,
                                                          optimizer=engine.optimizer, exception=error)
        raise error from wire.RemoteTraceback(f"(rank {failure.rank})\n{failure.traceback}")


def restore(parts: SessionParts, data: bytes) -> None:
    """A state sent home into the session's engine (its score table too); the history keeps its rows."""
    state = wire.state_from_bytes(data, 1)  # the kernel holds it in single-process terms
    engine = parts.engine
    engine.restore_state(state, announce=False)
    if state.scores is not None and engine.scores is not None:
        engine.scores.load_state_dict(json.loads(state.scores))


# ---- the three ways a call runs ------------------------------------------------------------------

_OWNERS: weakref.WeakKeyDictionary[Any, Processes] = weakref.WeakKeyDictionary()


def owner(session: Any, parts: SessionParts, driver: LoopDriver) -> Processes:
    found = _OWNERS.get(session)
    if found is None:
        found = _OWNERS[session] = Processes(parts, driver)
        weakref.finalize(session, found.close, force=True)
    return found


def train(session: Any, parts: SessionParts, driver: LoopDriver, goal: str, n: int, processes: int | None,
          live: bool | None, mode: str = "blocking") -> Any:
    """A train call on ``processes`` workers: the result (blocking), a coroutine (awaitable) or the thread
    (background). Returns None when the call is for the kernel alone (``processes`` 1, or None and the
    running epoch was trained in the kernel): the caller runs it as always."""
    if processes is None and session not in _OWNERS:
        return None
    procs = owner(session, parts, driver)
    size = procs.size(processes)
    if size == 1:
        return None
    if parts.breakpoints.step is not None or parts.breakpoints.when is not None:
        raise SessionStateError("break points stop a train call in this process: train with processes=1, or "
                                "clear them with session.break_on()")
    if mode == "awaitable":
        return run_async(procs, goal, n, size, live)
    if mode == "background":
        return run_background(procs, goal, n, size, live)
    return run_blocking(procs, goal, n, size, live)


def run_blocking(procs: Processes, goal: str, n: int, size: int, live: bool | None) -> TrainResult:
    driver, parts = procs.driver, procs.parts
    driver.guard.clear()
    with driver.guard.held(), parts.entered():
        if (done := driver.prepare(goal, live)) is not None:
            return done
        driver.mode = "blocking"
        with parts.engine.loop.driven(goal) as outcome, driver.errors_tracked(), _abandoned_on_error() as calls:
            call = procs.start(goal, n, size)
            calls.append(call)
            while not call.poll(POLL_SECS):
                pass
            return call.finish(outcome)


async def run_async(procs: Processes, goal: str, n: int, size: int, live: bool | None) -> TrainResult:
    driver, parts = procs.driver, procs.parts
    driver.guard.clear()
    with driver.guard.held():
        with parts.entered():
            if (done := driver.prepare(goal, live)) is not None:
                return done
        driver.mode = "awaitable"
        with parts.engine.loop.driven(goal) as outcome, _abandoned_on_error() as calls:
            with parts.entered(), driver.errors_tracked():
                call = procs.start(goal, n, size)
                calls.append(call)
            while True:
                with parts.entered(), driver.errors_tracked():
                    if call.poll(0.0):
                        return call.finish(outcome)
                await asyncio.sleep(0.02)  # the kernel handles widget messages (the Pause button)


def run_background(procs: Processes, goal: str, n: int, size: int, live: bool | None) -> threading.Thread:
    driver, parts = procs.driver, procs.parts
    if driver.thread is not None and driver.thread.is_alive():
        raise SessionStateError("this session is already training in the background; call wait() or pause()")
    driver.guard.clear()
    with parts.entered():
        done = driver.prepare(goal, live)
    driver.background = {} if done is None else {"result": done}
    driver.mode = "background"

    def target() -> None:
        try:
            with parts.entered(), parts.engine.loop.driven(goal) as outcome, driver.errors_tracked(), \
                    _abandoned_on_error() as calls:
                call = procs.start(goal, n, size)
                calls.append(call)
                while not call.poll(POLL_SECS):
                    pass
                driver.background["result"] = call.finish(outcome)
        except BaseException as exc:  # noqa: BLE001 - session.wait() raises it
            driver.background["error"] = exc

    driver.thread = threading.Thread(target=target if done is None else lambda: None,
                                     name="kit-session-processes", daemon=True)
    driver.thread.start()
    return driver.thread


@contextlib.contextmanager
def _abandoned_on_error() -> Iterator[list[Call]]:
    """The call's workers are stopped when the kernel leaves it without a result (an error here, a forced
    interrupt): a half-done call cannot be continued."""
    calls: list[Call] = []
    try:
        yield calls
    except BaseException:
        for call in calls:
            call.abandon()
        raise


def rank_status(session: Any) -> dict[int, wire.RankStatus]:
    """Where each worker of ``session`` stands (rank → :class:`RankStatus`); {} without workers."""
    found = _OWNERS.get(session)
    return dict(found.ranks) if found is not None else {}


def close(session: Any) -> None:
    """End ``session``'s worker processes (its close does)."""
    found = _OWNERS.pop(session, None)
    if found is not None:
        found.close()


def worker_pids(session: Any) -> list[int]:
    """The process ids of ``session``'s workers, rank by rank; [] without workers."""
    found = _OWNERS.get(session)
    if found is None or found.pool is None:
        return []
    return [found.pool.pids[rank] for rank in sorted(found.pool.pids)]


def startup_secs(session: Any) -> float | None:
    """How long the current workers took to start (spawn, import, join the group); None without workers."""
    found = _OWNERS.get(session)
    return found.pool.startup_secs if found is not None and found.pool is not None else None
