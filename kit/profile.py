"""torch's profiler for training: RETURNN's ``torch_profile`` key, and ``session.profile(steps=n)``.

``torch_profile`` (True or a dict, RETURNN's meaning): each train epoch runs under ``torch.profiler.profile``
with RETURNN's defaults (CPU and CUDA activities, ``profile_memory``, ``record_shapes``, ``with_stack``,
``with_flops``, ``schedule=dict(skip_first=10, wait=5, warmup=3, active=3, repeat=1)``); other dict entries go to
``torch.profiler.profile``, a dict ``schedule`` to ``torch.profiler.schedule``. When the schedule ends (or the
epoch's steps do) the Chrome trace is written to ``torch_profile.json`` (and, with ``profile_memory``, the memory
timeline to ``torch_memory_profile.html``) in the run folder: the folder of ``model`` (RETURNN: the working
directory, which is the run folder under Sisyphus), else the working directory. ``exit_after_profile`` (default
True): training stops then, as RETURNN exits (``python -m kit train`` exits with status 0, a Session's call
returns paused); ``once``: profile only one epoch per process; ``ranks``: the ranks that profile under torchrun
(default: local rank 0; ``.rank<r>`` is added to the file names when several can).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kit.errors import ConfigError

logger = logging.getLogger("kit")

_KIT_OPTIONS = ("exit_after_profile", "once", "ranks")


def profile_options(value: Any) -> dict[str, Any] | None:
    """``torch_profile`` as a dict of options (None: off), RETURNN's forms: True, 1, "true", a dict."""
    if isinstance(value, str):
        value = value.strip().lower() in ("1", "true", "yes", "on")
    if value is None or value is False or value == 0:
        return None
    if value is True or isinstance(value, int):
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"config key 'torch_profile': got {value!r}, expected True, False or a dict of "
                      "torch.profiler.profile options")


def check_profile(value: Any) -> str | None:
    """The config registry's check."""
    try:
        profile_options(value)
    except ConfigError:
        return "True, False or a dict of torch.profiler.profile options (+ exit_after_profile, once, ranks)"
    return None


def default_activities() -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def _schedule(opts: dict[str, Any]) -> int | None:
    """Turn a dict ``schedule`` into torch's; returns the step after which profiling stops (None: never)."""
    from torch.profiler import schedule

    spec = opts.get("schedule")
    if not isinstance(spec, Mapping):
        return None
    spec = {"repeat": 0, "skip_first": 0, **spec}
    skip_first_wait = spec.pop("skip_first_wait", 0)
    if skip_first_wait:
        spec["skip_first_wait"] = skip_first_wait
    opts["schedule"] = schedule(**spec)
    if not spec["repeat"]:
        return None
    last = (spec["wait"] + spec["warmup"] + spec["active"]) * spec["repeat"] + spec["skip_first"]
    return last - (spec["wait"] if skip_first_wait else 0)


class TorchProfile:
    """RETURNN's ``torch_profile`` as an event subscriber: one profiler per train epoch.

    ``request_stop(reason)`` ends training after the export when ``exit_after_profile``; ``steps_done()`` says
    whether the running epoch's steps are over (an eval at the epoch's end is not profiled)."""

    def __init__(self, options: Mapping[str, Any], run_dir: str, *, request_stop: Callable[[str], None],
                 steps_done: Callable[[], bool], rank: int | None = None, world_size: int = 1):
        opts = dict(options)
        self.exit_after = bool(opts.pop("exit_after_profile", True))
        self.once = bool(opts.pop("once", False))
        ranks = opts.pop("ranks", None)
        self.enabled, suffix = True, ""
        if rank is not None and world_size > 1:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            self.enabled = (local_rank == 0) if ranks is None else (ranks == "all" or rank in ranks)
            suffix = f".rank{rank}"
        self.trace_path = os.path.join(run_dir, f"torch_profile{suffix}.json")
        self.memory_path = os.path.join(run_dir, f"torch_memory_profile{suffix}.html")
        self._opts = opts
        self._request_stop, self._steps_done = request_stop, steps_done
        self._prof: Any = None
        self._max_step: int | None = None
        self.exported = False

    def attach(self, events: Any) -> TorchProfile:
        events.on("epoch_begin", self.on_epoch_begin)
        events.on("step_end", self.on_step_end)
        events.on("eval_begin", self.on_eval_begin)
        events.on("epoch_end", self.on_eval_begin)
        return self

    def _make(self) -> Any:
        from torch.profiler import profile

        opts = dict(self._opts)
        opts.setdefault("activities", default_activities())
        for key in ("profile_memory", "record_shapes", "with_stack", "with_flops"):
            opts.setdefault(key, True)
        opts.setdefault("schedule", dict(skip_first=10, wait=5, warmup=3, active=3, repeat=1))
        self._max_step = _schedule(opts)
        return profile(**opts)

    def on_epoch_begin(self, **_: Any) -> None:
        if not self.enabled or (self.once and self.exported):
            return
        logger.info("Using Torch profiler...")
        self._prof = self._make()
        self._prof.__enter__()

    def on_step_end(self, **_: Any) -> None:
        if self._prof is None:
            return
        self._prof.step()
        if self._max_step is not None and self._prof.step_num > self._max_step:
            logger.info("Reached max profiling step %d, stopping Torch profiler.", self._max_step)
            self._finish()

    def on_eval_begin(self, **_: Any) -> None:
        if self._prof is not None and self._steps_done():
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        logger.info("Torch profiling finished, exporting Chrome trace to %s", self.trace_path)
        prof.export_chrome_trace(self.trace_path)
        if prof.profile_memory:
            try:
                prof.export_memory_timeline(self.memory_path)
            except Exception as exc:  # the HTML timeline needs matplotlib; the trace is written anyway
                logger.warning("torch_profile: no memory timeline (%s: %s)", type(exc).__name__, exc)
        self.exported = True
        if self.exit_after:
            logger.info("Stopping after Torch profiling (exit_after_profile).")
            self._request_stop("torch_profile")

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


# ---- session.profile(steps=n) ----------------------------------------------------------------


@dataclass
class ProfileReport:
    """What ``session.profile(steps=n)`` measured: ``table`` (pandas DataFrame, the top ops by self time),
    ``trace_path`` (a Chrome trace: chrome://tracing, Perfetto) and ``result`` (the train call's TrainResult)."""

    table: Any
    trace_path: str
    result: Any

    def _repr_html_(self) -> str:
        return f"<p>trace: <code>{self.trace_path}</code></p>" + self.table.to_html()

    def __repr__(self) -> str:
        return f"trace: {self.trace_path}\n{self.table.to_string()}"


def top_ops(prof: Any, top: int = 20) -> Any:
    """The ``top`` ops of a finished profiler by self device time (self CPU time without a device) as a DataFrame."""
    import pandas as pd

    rows = []
    for e in prof.key_averages():
        rows.append({
            "name": e.key, "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1000, "cpu_total_ms": e.cpu_time_total / 1000,
            "self_device_ms": getattr(e, "self_device_time_total", 0) / 1000,
            "device_total_ms": getattr(e, "device_time_total", 0) / 1000,
            "cpu_memory_bytes": e.self_cpu_memory_usage, "flops": e.flops,
        })
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    key = "self_device_ms" if table["self_device_ms"].sum() > 0 else "self_cpu_ms"
    return table.sort_values(key, ascending=False).head(top).reset_index(drop=True)


def profile_steps(train_steps: Callable[[int], Any], steps: int, run_dir: str, name: str, *, top: int = 20,
                  **options: Any) -> ProfileReport:
    """Run ``train_steps(steps)`` under torch's profiler; the trace goes to ``run_dir/name``."""
    from torch.profiler import profile

    opts = {"activities": default_activities(), "record_shapes": True, "with_flops": True, **options}
    with profile(**opts) as prof:
        result = train_steps(steps)
    os.makedirs(run_dir or ".", exist_ok=True)
    path = os.path.join(run_dir, name)
    prof.export_chrome_trace(path)
    return ProfileReport(top_ops(prof, top), path, result)
