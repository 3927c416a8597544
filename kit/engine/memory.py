"""Memory figures of the engine's device, measured in one place: a step's CUDA peak, memory now, the run's peak.

On CUDA the engine reads the allocator's peak at the end of every step and starts a new
peak window (host-side counters: no device sync, no file I/O), so a step's peak is the same
whether or not anybody watches, and no view ever resets a counter. Everything else is read
only when a view, the history or the epoch end asks — the process RSS (a file read on
Linux) never inside a step.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryFigures:
    """Memory at one moment; CUDA devices fill the first three, others ``rss``."""

    allocated: int | None = None
    reserved: int | None = None
    step_peak: int | None = None  # the peak of the last train step
    rss: int | None = None  # the process' resident memory

    def columns(self) -> dict[str, int]:
        """The history's column names (``memory_allocated``, ``memory_reserved``, ``memory_peak``, ``memory_rss``)."""
        named = {"memory_allocated": self.allocated, "memory_reserved": self.reserved,
                 "memory_peak": self.step_peak, "memory_rss": self.rss}
        return {k: v for k, v in named.items() if v is not None}


class MemoryMeter:
    """The engine's memory readings; one per engine (its device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.last_step_peak: int | None = None
        self.run_peak = 0  # the largest step peak so far: the reset windows do not lose the run's peak

    def end_step(self) -> int | None:
        """The finished step's peak (CUDA; None elsewhere), and a new window for the next step."""
        if not self.cuda:
            return None
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.last_step_peak, self.run_peak = peak, max(self.run_peak, peak)
        return peak

    def now(self) -> MemoryFigures:
        """Memory now (for views and the history: never called inside a step)."""
        if self.cuda:
            return MemoryFigures(torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device),
                                 self.last_step_peak)
        return MemoryFigures(rss=process_rss_bytes())

    def peak_bytes(self) -> int:
        """The run's peak: on CUDA the largest allocation so far (eval since the last step included),
        else the process' peak resident memory."""
        if self.cuda:
            return max(self.run_peak, torch.cuda.max_memory_allocated(self.device))
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def process_rss_bytes() -> int:
    """The process' resident memory now (``/proc/self/statm``; the peak where that file does not exist)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
