"""The kernel's side of the worker processes: start them by spawning, talk to them, end them.

``torch.multiprocessing``'s spawn context starts each worker in a fresh interpreter (never a fork of
the kernel, so CUDA initialised in the kernel does not matter); the workers form a
``torch.distributed`` process group among themselves (TCP rendezvous on a free local port). A
pool lives until :meth:`WorkerPool.close` — the session's close, a new process count, a failure —
and at interpreter exit at the latest; a worker whose kernel is gone ends itself.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import time
import weakref
from typing import Any

from kit.multiproc import worker
from kit.multiproc.wire import RankStatus, WorkerError

START_TIMEOUT_SECS = 300.0
CLOSE_TIMEOUT_SECS = 10.0

_OPEN: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


class WorkerPool:
    """``size`` worker processes in one process group; ``backend`` ``"gloo"`` or ``"cpu:gloo,cuda:nccl"``."""

    def __init__(self, size: int, *, backend: str, threads: int):
        import torch.multiprocessing as mp

        self.size, self.backend, self.threads = size, backend, threads
        ctx = mp.get_context("spawn")
        self.replies = ctx.Queue()
        self.stop = ctx.Event()
        self.commands = [ctx.Queue() for _ in range(size)]
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.processes = [
            ctx.Process(target=worker.main, name=f"kit-worker-{rank}", daemon=False,
                        args=(rank, size, address, backend, threads, os.getpid(), self.commands[rank],
                              self.replies, self.stop))
            for rank in range(size)
        ]
        self.started = time.monotonic()
        self.pids: dict[int, int] = {}
        self.closed = False
        for process in self.processes:
            process.start()
        _OPEN.add(self)
        try:
            self.startup_secs = self.wait_ready()
        except BaseException:  # an interrupt while they start: none is left behind
            self.close(force=True)
            raise

    def wait_ready(self) -> float:
        """Until every rank joined the group; the seconds it took."""
        while len(self.pids) < self.size:
            for message in self.messages(timeout=0.5):
                if message[0] == "ready":
                    self.pids[message[1]] = message[2]
            if time.monotonic() - self.started > START_TIMEOUT_SECS:
                self.close(force=True)
                raise WorkerError(f"the {self.size} worker processes did not start within {START_TIMEOUT_SECS:.0f} s")
        return time.monotonic() - self.started

    def send(self, payload: bytes) -> None:
        """A call to every rank (the same payload)."""
        self.stop.clear()
        for commands in self.commands:
            commands.put(("run", payload))

    def request_stop(self) -> None:
        self.stop.set()

    def messages(self, timeout: float) -> list[tuple[Any, ...]]:
        """What the workers sent (waiting up to ``timeout`` for the first); raises when a worker died."""
        out = []
        try:
            out.append(self.replies.get(timeout=timeout) if timeout > 0 else self.replies.get_nowait())
            while True:
                out.append(self.replies.get_nowait())
        except queue.Empty:
            pass
        if not out:
            self.check_alive()
        return out

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.exitcode is not None and not self.closed:
                self.close(force=True)
                raise WorkerError(f"worker process of rank {rank} (pid {process.pid}) exited with code "
                                  f"{process.exitcode} (killed? out of memory?); the workers were stopped")

    @property
    def alive(self) -> bool:
        return not self.closed and all(p.exitcode is None for p in self.processes)

    def close(self, *, force: bool = False) -> None:
        """End the workers: asked to (``force``: at once), then terminated, then killed."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        if not force:
            for commands in self.commands:
                try:
                    commands.put(("close",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (0.0 if force else CLOSE_TIMEOUT_SECS)
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.0))
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        for process in self.processes:
            process.join(2.0)
            if process.exitcode is None:
                process.kill()
                process.join(2.0)
        for q in (self.replies, *self.commands):
            q.close()
            q.cancel_join_thread()


def status_lines(statuses: dict[int, RankStatus]) -> str:
    """The per-rank strip as text: ``rank 0: epoch 2 step 14 (global 54), 31.2 steps/s, 0.4 GB``."""
    lines = []
    for rank in sorted(statuses):
        s = statuses[rank]
        memory = f", {s.memory_bytes / 1e9:.2f} GB" if s.memory_bytes else ""
        lines.append(f"rank {rank} ({s.device}): epoch {s.epoch} step {s.step} (global {s.global_train_step}), "
                     f"{s.steps_per_sec:.1f} steps/s{memory}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@atexit.register
def _close_all() -> None:
    """At interpreter exit: no worker outlives the kernel (before multiprocessing joins its children)."""
    for pool in list(_OPEN):
        pool.close(force=True)
