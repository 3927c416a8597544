"""One worker process of a Session's ``processes=N``: a rank of a ``torch.distributed`` process group
with an engine of its own, kept between calls.

Started by spawning (a fresh interpreter: no state of the kernel, CUDA's included, is inherited), it
joins the group, then serves calls: ``("run", payload)`` steps its engine's loop towards the call's
goal exactly as a rank under torchrun does (the engine's DDP path: sharded data, averaged
gradients, rank 0 writes the files), and ``("close",)`` ends it. At every unit boundary the ranks
all-reduce the kernel's stop flag (on a gloo group: no device sync), so a pause reaches every rank
at the same step. Rank 0 streams its events to the kernel; every rank sends its status a few times
a second; when the call ends rank 0 sends its training state home.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from kit.multiproc import wire

STATUS_EVERY_SECS = 0.25
EVENTS_EVERY_SECS = 0.1


def main(rank: int, world_size: int, address: str, backend: str, threads: int, parent: int,
         commands: Any, replies: Any, stop: Any) -> None:
    """The worker's life: join the group, serve calls until ``close`` (or the kernel is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # "interrupt kernel" may signal the whole group: the kernel decides
    _exit_with_parent(parent)
    if threads:
        torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    importlib.import_module("torch.distributed.nn.functional")  # before the group (kit.engine.distributed says why)

    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo") if "nccl" in backend else None
    server = Worker(rank, world_size, replies, stop, control)
    replies.put(("ready", rank, os.getpid()))
    try:
        while True:
            command = commands.get()
            if command[0] == "close":
                break
            server.run(command[1])
    finally:
        server.close()
        dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """No orphans: a worker whose kernel is gone ends itself (checked every second)."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)  # the whole worker process at once, from this thread (no signal sent)

    threading.Thread(target=watch, name="kit-worker-parent-watch", daemon=True).start()


class Worker:
    """A rank's engine and the call protocol around it."""

    def __init__(self, rank: int, world_size: int, replies: Any, stop: Any, control: Any):
        self.rank, self.world_size, self.replies, self.stop, self.control = rank, world_size, replies, stop, control
        self.engine: Any = None
        self.failure: Any = None  # the DebugContext the debugger kept in this call
        self.pending: list[Any] = []  # rank 0's events not sent yet
        self.sent_at = self.status_at = time.monotonic()
        self.steps_since = 0

    # ---- a call ---------------------------------------------------------------------------------

    def run(self, payload: bytes) -> None:
        call = wire.loads(payload)
        self.failure = None
        try:
            if call["config"] is not None:
                self.build(call["config"])
            engine = self.engine
            engine.prepare_training()
            engine.take_prefix_lock()
            if call["state"] is not None:
                self.restore(call["state"])
            engine.set_final_epoch(call["final_epoch"])
            outcome, steps, last = self.drive(call["goal"], call["n"])
            self.send_status(time.monotonic())  # where each rank stopped
            self.flush()
            state = self.state_home()
            engine.release_prefix_lock()
            self.replies.put(("done", self.rank, {
                "outcome": outcome, "steps": steps, "last": wire.cpu_result(last) if last is not None else None,
                "state": state, "global_train_step": engine.progress.global_train_step}))
        except BaseException as exc:  # noqa: BLE001 - reported to the kernel, which stops every rank
            self.flush()
            failure = self.failed(exc)
            try:
                data = pickle.dumps(failure)
            except Exception:  # noqa: BLE001 - without its context and exception, the text still goes
                data = pickle.dumps(dataclasses.replace(failure, context=None, exception=None))
            self.replies.put(("error", self.rank, data))

    def build(self, config_bytes: bytes) -> None:
        """A new engine for a new config (the old one closed); rank 0 forwards its events."""
        from kit import Config
        from kit.engine.engine import Engine
        from kit.events import Event, Events

        if self.engine is not None:
            self.engine.close()
        config: Config = wire.loads(config_bytes)
        if config.typed_value("torch_distributed") is None:
            config.update({"torch_distributed": {}})
        events = Events()
        self.engine = Engine(config, events=events)
        self.engine.attach_debugger(lambda: _keep, self.keep_failure)
        events.on(Event.STEP_END, self.on_step_end)
        if self.rank == 0:
            for event in (Event.TRAIN_BEGIN, Event.EPOCH_BEGIN, Event.EVAL_BEGIN, Event.EVAL_END,
                          Event.CHECKPOINT_SAVED, Event.EPOCH_END, Event.TRAIN_END):
                events.on(event, self.forwarder(event))

    def keep_failure(self, ctx: Any) -> None:
        self.failure = ctx

    def restore(self, data: bytes) -> None:
        """The kernel's state (its score table too) on this rank."""
        import json

        state = wire.state_from_bytes(data, self.world_size)
        self.engine.restore_state(state, announce=False)
        if state.scores is not None:
            self.engine.scores.load_state_dict(json.loads(state.scores))

    def drive(self, goal: str, n: int) -> tuple[str, int, Any]:
        """Step the loop towards ``goal`` (the Session's units), stopping where every rank agrees to."""
        from kit.engine.loop import StepDone

        engine = self.engine
        steps, last, n_steps = 0, None, n if goal == "steps" else 0
        with engine.loop.driven(goal), engine.driver_call():
            while True:
                unit = engine.loop.next_unit()
                if isinstance(unit, StepDone):
                    steps, last = steps + 1, unit.result
                    if steps == n_steps:
                        return "done", steps, last
                elif unit is None:
                    return "finished", steps, last
                elif goal == "epoch":
                    return "done", steps, last
                if self.agreed_stop() and not engine.all_trained:
                    return "paused", steps, last

    def agreed_stop(self) -> bool:
        """Whether any rank saw the kernel's stop flag (one all-reduce of one number: every rank stops at the
        same unit boundary)."""
        flag = torch.tensor([1 if self.stop.is_set() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def state_home(self) -> bytes | None:
        """Rank 0's training state (mid-epoch with the loss sums of every rank so far), as bytes; None elsewhere."""
        from kit.engine.distributed import merge_accounting
        from kit.engine.state import cpu_copy

        engine = self.engine
        running = engine.progress.epoch_running
        if self.rank != 0 and not running:
            return None
        state = engine.capture()
        if running:  # every rank's sums so far, added in rank order (what a step checkpoint holds)
            sums: list[Any] = [None] * self.world_size
            dist.all_gather_object(sums, cpu_copy(state.accounting), group=self.control)  # gloo: on the CPU
            state.accounting = merge_accounting(sums)
        return wire.state_bytes(state, self.world_size) if self.rank == 0 else None

    def failed(self, exc: BaseException) -> wire.Failure:
        """What the kernel needs of an error: text, traceback, the exception, the step's context and state."""
        pickled: bytes | None = None
        try:
            pickled = pickle.dumps(exc)
            wire.loads(pickled)  # the kernel must be able to read it back
        except Exception:  # noqa: BLE001 - then the text and traceback alone
            pickled = None
        ctx, context, state = self.failure, None, None
        if ctx is not None and ctx.event in ("exception", "nonfinite"):
            context = {name: getattr(ctx, name) for name in ("event", "epoch", "step", "global_train_step", "stage",
                                                             "batch", "losses", "module_stack", "rng_state",
                                                             "nonfinite")}
        try:
            if self.engine is not None and self.engine.is_set_up:
                state = wire.state_bytes(self.engine.capture(), self.world_size)
        except Exception:  # noqa: BLE001 - a failure without its state still reports
            state = None
        return wire.Failure(self.rank, type(exc).__name__, str(exc), traceback.format_exc(), pickled, context, state)

    # ---- what the kernel sees live ------------------------------------------------------------------

    def on_step_end(self, result: Any) -> None:
        self.steps_since += 1
        if self.rank == 0:
            self.pending.append(("event", "step_end", result))
        now = time.monotonic()
        if now - self.status_at >= STATUS_EVERY_SECS:
            self.send_status(now)
        if self.rank == 0 and now - self.sent_at >= EVENTS_EVERY_SECS:
            self.flush()

    def send_status(self, now: float) -> None:
        engine = self.engine
        memory = engine.memory_now()
        used = None
        if memory is not None:
            used = getattr(memory, "allocated", None) or getattr(memory, "rss", None)
        rate = self.steps_since / max(now - self.status_at, 1e-9)
        self.status_at, self.steps_since = now, 0
        p = engine.progress
        self.replies.put(("status", self.rank, wire.RankStatus(self.rank, p.epoch, p.step_in_epoch,
                                                                p.global_train_step, rate, used, str(engine.device))))

    def forwarder(self, event: Any) -> Any:
        def forward(**payload: Any) -> None:
            self.pending.append(("event", event.value, payload))
            if event.value in ("epoch_end", "eval_end"):
                self.pending.append(("scores", self.engine.scores.state_dict()))
                self.flush()

        forward.__qualname__ = f"kit.multiproc.forward_{event.value}"
        return forward

    def flush(self) -> None:
        """Rank 0's pending events to the kernel, step results copied to the CPU (one device read per flush)."""
        self.sent_at = time.monotonic()
        if not self.pending:
            return
        out = []
        for item in self.pending:
            if item[0] == "event" and item[1] == "step_end":
                item = ("event", "step_end", {"result": wire.cpu_result(item[2])})
            out.append(item)
        self.pending = []
        self.replies.put(("events", self.rank, _pickled(out)))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _pickled(items: list[Any]) -> bytes:
    """The items pickled here (a queue pickles in a thread of its own, where an error would be lost); an item
    that does not pickle is left out, training goes on."""
    import pickle

    try:
        return pickle.dumps(items)
    except Exception:  # noqa: BLE001
        kept = []
        for item in items:
            try:
                pickle.dumps(item)
                kept.append(item)
            except Exception:  # noqa: BLE001
                pass
        return pickle.dumps(kept)


def _keep(ctx: Any) -> None:
    """The workers' debug hook: keep the context (an error's goes home with the error)."""
    ctx.keep()
