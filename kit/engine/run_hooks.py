"""RETURNN's run-time hooks of the config: callbacks and memory switches the engine calls at fixed points.

- ``startup_callback(config=config)``: once, when the engine sets up (RETURNN: at start-up, before the data);
- ``epoch_start`` / ``epoch_end``: ``fn(*, epoch, step, model, dataset_name, **kwargs)`` around the train epoch
  (``dataset_name="train"``; the end before the epoch's checkpoint and eval) and around each eval dataset;
- ``reset_dev_memory_caches``: ``gc.collect()`` and ``torch.cuda.empty_cache()`` before each train epoch,
  eval and forward;
- ``watch_memory``: a daemon thread logs the memory (RSS) of this process and its children when it grows
  (RETURNN's ``MEMORY:`` lines, every 5 seconds);
- ``log_batch_size`` (with ``log_verbosity`` >= 5, as RETURNN): a line per train step with the batch's
  ``num_seqs``, and per data key with a time axis ``max_size:<key>`` and ``sum_size:<key>`` (the frames of
  content, without padding);
- ``torch_watch_stall``: a daemon thread dumps the stacks when no train step began for its timeout
  (:mod:`kit.engine.watch_stall`);
- ``use_lovely_tensors``: ``lovely_tensors.monkey_patch()`` (a warning when it is not installed);
- ``PYTORCH_CUDA_ALLOC_CONF``: set in the environment before CUDA starts (not under ``torch_distributed``,
  as RETURNN; a warning when CUDA has started already).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from kit.engine.watch_stall import StallWatcher, watch_options

logger = logging.getLogger("kit")


class RunHooks:
    """The config's hooks, read once; the engine calls :meth:`epoch_start` / :meth:`epoch_end` / ... ."""

    def __init__(self, config: Any):
        self.config = config
        self._watcher: MemoryWatcher | None = None
        self._profile: Any = None
        self._stall: StallWatcher | None = None

    def startup(self) -> None:
        """Before the engine builds anything: environment, lovely_tensors, memory watcher, startup_callback."""
        cfg = self.config
        alloc_conf = cfg.typed_value("PYTORCH_CUDA_ALLOC_CONF")
        if alloc_conf is not None:
            set_cuda_alloc_conf(str(alloc_conf), distributed=cfg.typed_value("torch_distributed") is not None)
        if cfg.bool("use_lovely_tensors"):
            try:
                import lovely_tensors  # type: ignore[import-not-found,unused-ignore]

                lovely_tensors.monkey_patch()
            except ImportError as exc:
                logger.warning("use_lovely_tensors: could not import lovely_tensors: %s", exc)
        if cfg.bool("watch_memory") and self._watcher is None:
            self._watcher = MemoryWatcher()
            self._watcher.start()
        callback = cfg.typed_value("startup_callback")
        if callback is not None:
            callback(config=cfg)

    def attach(self, events: Any, *, request_stop: Callable[[str], None], final_epoch: Callable[[], int],
               progress: Callable[[], Any], rank: int | None = None, world_size: int = 1,
               training: bool = True) -> None:
        """Subscribe what listens to the loop: ``log_batch_size``, ``torch_profile``, the resubmission check."""
        cfg = self.config
        if cfg.bool("log_batch_size") and cfg.int("log_verbosity") >= 5:
            events.on("step_begin", log_batch_size)
        if not training:
            return
        from kit.profile import TorchProfile, profile_options

        opts = profile_options(cfg.typed_value("torch_profile"))
        if opts is not None:
            model = cfg.typed_value("model")
            run_dir = os.path.dirname(os.path.abspath(model)) if model else os.getcwd()
            self._profile = TorchProfile(opts, run_dir, request_stop=request_stop,
                                         steps_done=lambda: progress().steps_exhausted, rank=rank,
                                         world_size=world_size).attach(events)
        stall = watch_options(cfg.typed_value("torch_watch_stall"))
        if stall is not None and self._stall is None:
            self._stall = StallWatcher(**stall).start()
            for event in ("run_begin", "step_begin"):
                events.on(event, self._stall.beat)
            events.on("run_end", self._stall.pause)
        if cfg.bool("stop_for_resubmission_when_low_time_left"):
            from kit.engine.resubmission import ResubmissionCheck

            ResubmissionCheck(cfg.float("stop_for_resubmission_safety_factor"), request_stop, final_epoch).attach(events)

    def reset_memory_caches(self) -> None:
        if self.config.bool("reset_dev_memory_caches"):
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def epoch_start(self, *, epoch: int, step: int, model: Any, dataset_name: str) -> None:
        self._call("epoch_start", epoch=epoch, step=step, model=model, dataset_name=dataset_name)

    def epoch_end(self, *, epoch: int, step: int, model: Any, dataset_name: str) -> None:
        self._call("epoch_end", epoch=epoch, step=step, model=model, dataset_name=dataset_name)

    def _call(self, key: str, **kwargs: Any) -> None:
        fn: Callable[..., Any] | None = self.config.typed_value(key)
        if fn is not None:
            fn(**kwargs)

    def close(self) -> None:
        if self._profile is not None:
            self._profile.close()
        if self._stall is not None:
            self._stall.stop()
            self._stall = None
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None


def set_cuda_alloc_conf(value: str, *, distributed: bool) -> bool:
    """``PYTORCH_CUDA_ALLOC_CONF=value`` in the environment when it can still take effect; True when set."""
    if distributed:  # RETURNN: torchrun's workers have started torch's allocator already
        logger.warning("PYTORCH_CUDA_ALLOC_CONF does not work with torch_distributed, not used")
        return False
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        logger.warning("PYTORCH_CUDA_ALLOC_CONF=%r: CUDA has started already in this process, so it cannot take "
                       "effect; set the environment variable before starting Python", value)
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
    logger.info("Set PYTORCH_CUDA_ALLOC_CONF=%r.", value)
    return True


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f}TB"


def _rss_by_pid() -> dict[int, int]:
    """RSS of this process and its children (psutil when installed; else this process, from /proc)."""
    try:
        import psutil  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return {os.getpid(): int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}
        except OSError:
            return {}
    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            out[proc.pid] = proc.memory_info().rss
        except psutil.Error:  # gone meanwhile
            continue
    return out


class MemoryWatcher:
    """RETURNN's ``watch_memory``: ``MEMORY:`` log lines when a process appears, grows (to the next shown
    size) or exits; checked every ``interval`` seconds in a daemon thread."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kit watch_memory", daemon=True)
        self._seen: dict[int, int] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> list[str]:
        """One look: the lines to log (also what the thread logs)."""
        now, main, lines = _rss_by_pid(), os.getpid(), []
        for pid in [p for p in self._seen if p not in now]:
            lines.append(f"MEMORY: proc {pid} exited, old: rss={_human(self._seen.pop(pid))}")
        for pid, rss in now.items():
            kind = "main" if pid == main else "sub"
            old = self._seen.get(pid)
            if old is None:
                lines.append(f"MEMORY: {kind} proc {pid} initial: rss={_human(rss)}")
            elif rss > old and _human(rss) != _human(old):
                lines.append(f"MEMORY: {kind} proc {pid} increased RSS: rss={_human(rss)}")
            else:
                continue
            self._seen[pid] = rss
        if lines:
            lines.append(f"MEMORY: total ({len(self._seen)} procs): rss={_human(sum(self._seen.values()))}")
        return lines

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in self.check():
                logger.info(line)
            self._stop.wait(self.interval)


def batch_size_info(batch: Any) -> dict[str, int]:
    """RETURNN's batch size info: ``num_seqs``, ``max_size:<key>`` and ``sum_size:<key>`` per key with lengths."""
    info = {"num_seqs": int(batch.num_seqs)}
    for key, field in batch.items():
        if field.lengths is not None:
            info[f"max_size:{key}"] = int(field.tensor.shape[1])
            info[f"sum_size:{key}"] = int(field.lengths.sum())
    return info


def log_batch_size(epoch: int, step: int, batch: Any, **_: Any) -> None:
    logger.info("ep %d train step %d batch size: %s", epoch, step,
                ", ".join(f"{k} {v}" for k, v in batch_size_info(batch).items()))
