"""How the views write numbers: losses, scores, durations, bytes, memory and the one-line progress.

Shared by the dashboard, the notebook progress line and the terminal bar, so that each figure
reads the same wherever it is shown.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kit.widgets.timeline import Timeline


def format_seconds(secs: float) -> str:
    secs = int(round(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def format_losses(timeline: Timeline) -> str:
    return " ".join(f"{name} {value:.3g}" for name, value in timeline.latest_losses().items())


def format_scores(scores: dict[str, float]) -> str:
    keys = [k for k in scores if k != "learning_rate"] or list(scores)
    return " · ".join(f"{k} {scores[k]:.3g}" for k in keys)


def format_bytes(n: float) -> str:
    if not math.isfinite(n):
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_text(memory: dict[str, int]) -> str:
    """CUDA allocated / reserved / step peak, or the process RSS."""
    if "memory_allocated" in memory:
        labels = [("memory_allocated", "allocated"), ("memory_reserved", "reserved"), ("memory_peak", "step peak")]
        return "GPU memory: " + " · ".join(f"{label} {format_bytes(memory[key])}" for key, label in labels
                                           if key in memory)
    return f"memory: process RSS {format_bytes(memory['memory_rss'])}"


def progress_text(timeline: Timeline, num_epochs: int, *, running: bool = True) -> str:
    """epoch, step in epoch, percent, ETA, seconds/step, learning rate, smoothed losses."""
    last = timeline.last
    if not last:
        return "no training step yet"
    parts = [f"epoch {last['epoch']}/{num_epochs}", f"step {last['step'] + 1}"]
    frac = last["complete_frac"]
    if frac:
        parts[-1] += f" of ≈{round((last['step'] + 1) / min(frac, 1.0))}"
        parts.append(f"{100 * min(frac, 1.0):.0f}%")
    eta, rate = timeline.epoch_eta(), timeline.seconds_per_step()
    if eta is not None and running:
        parts.append(f"ETA epoch {format_seconds(eta)}")
    if rate is not None:
        parts.append(f"{rate:.3g} s/step")
    parts.append(f"lr {last['learning_rate']:.3g}")
    losses = format_losses(timeline)
    return " · ".join(parts + ([losses] if losses else []))
