"""Loss accounting on the device: per-step values and per-epoch sums without host syncs.

RETURNN turns every loss into a Python float each step (about two device→host reads
per loss). Here sums and inverse norm factors stay device tensors; numbers reach
Python only when someone reads them (log interval, history, epoch end).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class StepLosses:
    """One step's losses: ``values[0]`` sums, ``values[1]`` inverse norm factors (device)."""

    names: list[str]
    values: torch.Tensor  # [2, num_losses] on the device
    errors: frozenset[str] = frozenset()
    _cache: dict[str, float] | None = field(default=None, repr=False)

    def normalized(self) -> dict[str, float]:
        """sum / norm per loss name (one device→host read, cached)."""
        if self._cache is None:
            host = self.values.detach().to("cpu", torch.float64)
            self._cache = {n: float(host[0, i] / host[1, i]) for i, n in enumerate(self.names)}
        return dict(self._cache)


def stack_losses(losses: Mapping[str, Any]) -> StepLosses:
    """Stack the run context's losses (``Loss`` objects) into one device tensor."""
    names = list(losses)
    if not names:
        return StepLosses([], torch.zeros(2, 0))
    sums, norms, device = [], [], None
    for loss in losses.values():
        s = loss.sum.detach()
        device = s.device
        sums.append(s.to(_acc_dtype(device)).reshape(()))
    for loss in losses.values():
        n = loss.inv_norm_factor
        n = n.detach() if isinstance(n, torch.Tensor) else torch.tensor(float(n))
        norms.append(n.to(device=device, dtype=_acc_dtype(device)).reshape(()))
    errors = frozenset(n for n, loss in losses.items() if loss.as_error)
    return StepLosses(names, torch.stack([torch.stack(sums), torch.stack(norms)]), errors)


class EpochAccounting:
    """Σ sums and Σ norms per loss name over an epoch (or an eval pass), on the device."""

    def __init__(self) -> None:
        self.totals: dict[str, torch.Tensor] = {}  # name -> [2] (sum, norm)
        self.errors: set[str] = set()
        self.num_steps = 0

    def add(self, step: StepLosses) -> None:
        for i, name in enumerate(step.names):
            pair = step.values[:, i]
            prev = self.totals.get(name)
            self.totals[name] = pair.clone() if prev is None else prev + pair
        self.errors |= step.errors
        self.num_steps += 1

    def scores(self, prefix: str) -> dict[str, float]:
        """``{prefix + name: Σ sum / Σ norm}`` — frame-weighted, RETURNN's epoch score."""
        if not self.totals:
            return {}
        names = list(self.totals)
        host = torch.stack([self.totals[n] for n in names]).to("cpu", torch.float64)
        return {prefix + n: float(host[i, 0] / host[i, 1]) for i, n in enumerate(names)}

    def error_keys(self, prefix: str) -> set[str]:
        return {prefix + n for n in self.errors}

    def state_dict(self) -> dict[str, Any]:
        return {
            "totals": {n: t.detach().cpu() for n, t in self.totals.items()},
            "errors": sorted(self.errors),
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.totals = {n: t.to(device) for n, t in state["totals"].items()}
        self.errors = set(state["errors"])
        self.num_steps = int(state["num_steps"])
