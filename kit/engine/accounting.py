"""Loss accounting on the device: per-step values and per-epoch sums without host syncs.

RETURNN turns every loss into a Python float each step (about two device→host reads
per loss). Here sums and inverse norm factors stay device tensors; numbers reach
Python only when someone reads them (log interval, history, epoch end).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


GRAD_NORM_PREFIX = "grad_norm:p"  # RETURNN's log_grad_norm score: not a loss of the run context


def grad_norm_name(p: float) -> str:
    """RETURNN's score name of the p-norm of the gradients (``grad_norm:p2``, ``grad_norm:p1.5``)."""
    return GRAD_NORM_PREFIX + str(p).rstrip("0").rstrip(".")


def with_exp(values: Mapping[str, float], skip: Iterable[str] = ()) -> dict[str, float]:
    """RETURNN's ``calculate_exp_loss``: ``<name>:exp`` = exp(value) right after each loss that is not an
    error (``skip``) nor the gradient norm (a perplexity for a cross-entropy); overflow gives inf."""
    skipped, out = set(skip), {}
    for key, value in values.items():
        out[key] = value
        if key not in skipped and GRAD_NORM_PREFIX not in key:
            try:
                out[f"{key}:exp"] = math.exp(value)
            except OverflowError:
                out[f"{key}:exp"] = float("inf")
    return out


class StepLosses:
    """One step's losses on the device: a sum and an inverse norm factor per name.

    ``values`` (``[2, num_losses]``: row 0 sums, row 1 norms, in the accumulation dtype)
    is stacked on first use only: every torch op costs microseconds of host time per step,
    and the epoch accounting adds the scalars as they are.
    """

    __slots__ = ("names", "sums", "norms", "errors", "exp", "_values", "_cache")

    def __init__(self, names: list[str], sums: list[torch.Tensor], norms: list[torch.Tensor],
                 errors: frozenset[str] = frozenset(), exp: bool = False):
        self.names, self.sums, self.norms, self.errors = names, sums, norms, errors
        self.exp = exp  # calculate_exp_loss: what is reported adds <name>:exp
        self._values: torch.Tensor | None = None
        self._cache: dict[str, float] | None = None

    def with_score(self, name: str, value: torch.Tensor) -> StepLosses:
        """These losses and one more score of norm 1 (RETURNN's ``grad_norm:p2`` of an update step)."""
        one = torch.ones((), dtype=torch.float64, device=value.device)
        return StepLosses([*self.names, name], [*self.sums, value.detach()], [*self.norms, one], self.errors, self.exp)

    def reported(self, normalized: Mapping[str, float] | None = None) -> dict[str, float]:
        """What a log line shows of these losses: :meth:`normalized`, with ``:exp`` scores when asked."""
        values = self.normalized() if normalized is None else dict(normalized)
        return with_exp(values, self.errors) if self.exp else values

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            if not self.names:
                self._values = torch.zeros(2, 0)
            else:
                dtype = _acc_dtype(self.sums[0].device)
                self._values = torch.stack([t.to(dtype) for t in (*self.sums, *self.norms)]).view(2, -1)
        return self._values

    def normalized(self) -> dict[str, float]:
        """sum / norm per loss name (one device→host read, cached)."""
        if self._cache is None:
            host = self.values.detach().to("cpu", torch.float64)
            self._cache = {n: float(host[0, i] / host[1, i]) for i, n in enumerate(self.names)}
        return dict(self._cache)

    def __repr__(self) -> str:
        return f"StepLosses({self.names}, errors={sorted(self.errors)})"


def stack_losses(losses: Mapping[str, Any]) -> StepLosses:
    """The run context's losses (``Loss`` objects) as detached device scalars — no torch op but detach."""
    names, sums, norms, errors = list(losses), [], [], []
    for name, loss in losses.items():
        s, n = loss.sum, loss.inv_norm_factor  # mark_as_loss makes both 0-d tensors on the loss' device
        if s.requires_grad:
            s = s.detach()
        sums.append(s.reshape(()) if s.dim() else s)
        norms.append(n if isinstance(n, torch.Tensor) else torch.tensor(float(n), dtype=torch.float64, device=s.device))
        if loss.as_error:
            errors.append(name)
    return StepLosses(names, sums, norms, frozenset(errors) if errors else _NO_ERRORS)


_NO_ERRORS: frozenset[str] = frozenset()


def read_normalized(step_losses: list[Any]) -> list[dict[str, float]]:
    """Normalized losses of many steps: on the CPU read scalar by scalar (host memory, no torch op),
    elsewhere with one stack and one device→host copy per loss set."""
    out: list[dict[str, float]] = []
    groups: dict[tuple, list[int]] = {}  # (names, device) -> steps whose losses are on a device
    for i, losses in enumerate(step_losses):
        sums = getattr(losses, "sums", None)
        if sums and sums[0].is_cpu:  # (reading each exact scalar costs a tenth of stacking them)
            out.append(dict(zip(losses.names, map(_host_ratio, sums, losses.norms))))
            continue
        out.append({})
        if losses is not None and losses.names:
            groups.setdefault((tuple(losses.names), losses_device(losses)), []).append(i)
    for (names, _), idx in groups.items():
        k = len(names)
        if all(hasattr(step_losses[i], "sums") for i in idx):
            with torch.no_grad():  # sums and norms promote to one dtype
                scalars = [t for i in idx for t in (*step_losses[i].sums, *step_losses[i].norms)]
                host = torch.stack(scalars).to("cpu", torch.float64).view(len(idx), 2, k)
        else:
            host = torch.stack([step_losses[i].values.detach() for i in idx]).to("cpu", torch.float64)
        ratios = (host[:, 0, :] / host[:, 1, :]).tolist()
        for row, i in zip(ratios, idx):
            out[i] = dict(zip(names, row))
    return out


def _host_ratio(loss_sum: torch.Tensor, norm: torch.Tensor) -> float:
    """``sum / norm`` of two CPU scalars in float64, as torch divides (0 / 0 is NaN, x / 0 is ±inf)."""
    d = norm.item()
    if d:
        return loss_sum.item() / d
    return float(torch.tensor(loss_sum.item(), dtype=torch.float64) / d)


def losses_device(losses: StepLosses) -> torch.device:
    """The device a step's loss scalars live on."""
    sums = getattr(losses, "sums", None)
    return sums[0].device if sums else losses.values.device


class EpochAccounting:
    """Σ sums and Σ norms per loss name over an epoch (or an eval pass), on the device."""

    def __init__(self) -> None:
        self._totals: dict[str, torch.Tensor] = {}  # name -> [2] (sum, norm)
        # steps that mark the same losses (the usual case) add their scalars in place into
        # running accumulators: two small ops per loss and step, like a hand-written loop
        self._run_names: list[str] | None = None
        self._run: list[torch.Tensor] = []  # sums, then norms
        self._pending: list[StepLosses] = []  # steps not yet added into _run
        self.errors: set[str] = set()
        self.num_steps = 0

    block = 32  # steps summed with one stack per loss: ~1 torch op per step instead of 2 per loss

    def add(self, step: StepLosses) -> None:
        if step.names != self._run_names:
            self._flush()
            self._run_names = list(step.names)
            if step.names:
                dtype = _acc_dtype(step.sums[0].device)
                self._run = [torch.zeros((), dtype=dtype, device=t.device) for t in (*step.sums, *step.norms)]
        self._pending.append(step)
        if len(self._pending) >= self.block:
            self._add_pending()
        if step.errors:
            self.errors |= step.errors
        self.num_steps += 1

    def _add_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending or not self._run_names:
            return
        n = len(self._run_names)
        for i, acc in enumerate(self._run):
            column = [s.sums[i] for s in pending] if i < n else [s.norms[i - n] for s in pending]
            # added step after step onto the running total, as RETURNN adds them: a cumulative sum is
            # that order exactly, where torch's sum of a vector adds in lanes whose number (and so
            # the rounding of float64 losses) depends on the CPU's vector width (AVX2, AVX-512)
            acc.copy_(torch.cat([acc.view(1), torch.stack(column).to(acc.dtype)]).cumsum(0)[-1])

    @property
    def totals(self) -> dict[str, torch.Tensor]:
        """Name → ``[Σ sum, Σ norm]`` (device tensors)."""
        self._flush()
        return self._totals

    @totals.setter
    def totals(self, value: dict[str, torch.Tensor]) -> None:
        self._run_names, self._run, self._pending, self._totals = None, [], [], value

    def _flush(self) -> None:
        self._add_pending()
        if self._run_names:
            n = len(self._run_names)
            for i, name in enumerate(self._run_names):
                pair, prev = torch.stack([self._run[i], self._run[n + i]]), self._totals.get(name)
                self._totals[name] = pair if prev is None else prev + pair
        self._run_names, self._run = None, []

    def scores(self, prefix: str, *, exp: bool = False) -> dict[str, float]:
        """``{prefix + name: Σ sum / Σ norm}`` — frame-weighted, RETURNN's epoch score; ``exp``: with RETURNN's
        ``<name>:exp`` scores (``calculate_exp_loss``)."""
        if not self.totals:
            return {}
        names = list(self.totals)
        host = torch.stack([self.totals[n] for n in names]).to("cpu", torch.float64)
        values = {prefix + n: float(host[i, 0] / host[i, 1]) for i, n in enumerate(names)}
        return with_exp(values, self.error_keys(prefix)) if exp else values

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
