"""``NonFiniteGuard``: no update from a NaN/Inf loss or gradient, and no host read per step.

Every micro-batch's losses and (accumulated, not yet clipped) gradients go through one
fused check, ``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of 1 (the op
``GradScaler`` uses), that sets a device flag. The flag is sticky: once set, no later
update changes the weights. How the flag is read depends on ``nonfinite_check``:

* ``"immediate"`` (``"auto"`` on a CPU device, where the flag is host memory and reading it
  costs no sync; also always under ``nonfinite_policy="skip"``): after each micro-batch;
  the bad micro-batch is reported at once and its update never runs.
* ``"deferred"`` (``"auto"`` on an accelerator): never per step. The update is skipped on
  the device (a fused optimizer's ``found_inf``, else a where-select of parameters and
  optimizer state against a copy made before the step), module buffers are kept in a
  backup that stops following them at the first bad micro-batch, and each step records
  what is cheap on the host (counters, its batch, its losses, the RNG after it). The flag
  is read where the host reads losses anyway — log lines, checkpoints, the epoch end and
  the return of a ``train_*`` call (:meth:`deferred_reads` marks a driver's call) — and
  when it is set, the session is rewound to right after the first bad micro-batch before
  the error is raised, as if the later steps had never run.

In both modes the report is the same: ``NonFiniteLossError`` naming the micro-batch whose
loss or gradient first turned non-finite, the ``nonfinite`` event, and the debug hook with
that micro-batch's batch (``session.last_failure``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kit import rng
from kit.engine.accounting import StepLosses
from kit.errors import ConfigError, NonFiniteLossError

if TYPE_CHECKING:
    from kit.data.batch import Batch
    from kit.engine.debugging import RngState
    from kit.engine.engine import Engine
    from kit.engine.progress import Progress

logger = logging.getLogger("kit")

_MAX_NAMED_GRADS = 20
_grad_of = operator.attrgetter("grad")
_is_tensor = functools.partial(operator.is_not, None)


@dataclass
class _StepRecord:
    """What a deferred read needs to rewind to right after one micro-batch."""

    flag: torch.Tensor  # the sticky flag after this micro-batch's check (device)
    progress: Progress  # Progress before the step
    batch: Batch
    step_losses: StepLosses
    rng_before: RngState | None  # the torch RNG before user code ran (only with a debugger: replay)
    rng_after: tuple | None = None  # torch's RNG after the step (and numpy's / Python's once they are seen used)


class NonFiniteGuard:
    """The engine's non-finite guard; the engine calls it at fixed points of its step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._found: torch.Tensor | None = None  # 0-d float flag, sticky until a report
        self._params: list[torch.nn.Parameter] | None = None
        self._one: torch.Tensor | None = None
        self._mode: str | None = None
        self._live: str | None = None  # this step's mode, or None when the guard is off (set by begin_step)
        self._param_dtype: torch.dtype | None = None  # the parameters' one dtype (None: several)
        self._records: list[_StepRecord] = []
        self._buffers: list[torch.Tensor] | None = None
        self._buffer_backup: list[torch.Tensor] = []
        self._opt_backup: list[torch.Tensor] = []
        self._opt_live: list[torch.Tensor] = []
        self._opt_host: list[torch.Tensor] = []
        # (records before the update, host-side state tensors, their values before it), since the last read
        self._host_log: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []
        self._opt_state_len = -1
        self._new_state: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (flag at creation, params)
        self._depth = 0  # open deferred_reads() scopes
        # numpy's and Python's global RNG cost ~60 µs a step to snapshot: they are recorded per
        # step only once a read found them drawn from; until then, once per read period
        self._host_rng_used = False
        self._host_rng_start: tuple | None = None

    # ---- configuration ------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return bool(self.engine.step_options.guard)

    @property
    def mode(self) -> str:
        """``"immediate"`` or ``"deferred"`` (``nonfinite_check`` resolved for this device)."""
        if self._mode is None:
            self._mode = self._resolve_mode()
        return self._mode

    def _resolve_mode(self) -> str:
        config = self.engine.config
        wanted, skip = config.typed_value("nonfinite_check"), config.typed_value("nonfinite_policy") == "skip"
        if wanted == "deferred" and skip:
            raise ConfigError("config key 'nonfinite_check': 'deferred' cannot be combined with "
                              "nonfinite_policy='skip' (a skipped step is counted and training goes on at "
                              "once, which needs the flag after every micro-batch); use 'immediate' or 'auto'")
        if wanted == "auto":
            devices = {p.device for p in self.engine.built_model.parameters()}
            on_cpu = self.engine.built_device.type == "cpu"
            # under torchrun each rank has its own flag: ranks must not disagree on skipping an update
            return "immediate" if skip or on_cpu or len(devices) > 1 or self.engine.dist else "deferred"
        return str(wanted)

    @property
    def pending(self) -> bool:
        """Steps whose flag was not read yet (deferred mode)."""
        return bool(self._records)

    def config_changed(self) -> None:
        """The config changed (e.g. ``nonfinite_policy``): resolve the mode again at the next step."""
        if not self._records:
            self._mode = None

    def reset(self) -> None:
        """Forget the flag, the records and the backups (after a restore or a config change)."""
        self._found = self._one = self._mode = self._live = self._buffers = self._params = self._param_dtype = None
        self._records.clear()
        self._buffer_backup, self._opt_backup, self._opt_live, self._new_state = [], [], [], []
        self._opt_host, self._host_log = [], []
        self._opt_state_len = -1

    def _flag(self) -> torch.Tensor:
        if self._found is None:
            device = self.engine.device
            # float32 whatever the default dtype: the fused check wants float32 flag and scale
            self._found = torch.zeros((), dtype=torch.float32, device=device)
            self._one = torch.ones((), dtype=torch.float32, device=device)
        return self._found

    # ---- the step's hooks ---------------------------------------------------------------

    def refresh(self) -> None:
        """Resolve whether the guard is on, and its mode, from the config as it is now (the hooks
        below read the result: each of their lines costs host time on every step)."""
        self._live = self.mode if self.enabled else None

    def begin_step(self) -> None:
        """Before the step's forward: the module buffers' backup, taken fresh whenever no unread
        step depends on it (so whatever changed them between steps, e.g. a restore, is kept)."""
        self.refresh()
        if self._live is None:
            return
        buffers = self._model_buffers()
        if buffers and (self._live == "immediate" or not self._records):
            torch._foreach_copy_(self._buffer_backup, buffers)

    def after_backward(self, step_losses: StepLosses, batch: Batch, *, rng_before: RngState | None) -> bool:
        """Check this micro-batch's losses and the gradients so far (before any clipping).

        Returns False when the micro-batch was non-finite and skipped (immediate mode,
        ``nonfinite_policy="skip"``); raises ``NonFiniteLossError`` under "raise".
        """
        live = self._live
        if live is None:
            return True
        found = self._flag()
        self._check(found, step_losses)
        if live == "immediate":
            if found:  # immediate mode's read: host memory on a CPU device (no sync)
                self._keep_buffers(True)
                return self._report(batch, step_losses, rng_before)
            return True
        self._keep_buffers_on_device(found)
        if not self._records and not self._host_rng_used:
            self._host_rng_start = _host_rng()
        self._records.append(_StepRecord(found.clone(), copy.copy(self.engine.progress), batch,
                                         step_losses, rng_before))
        return True

    def _check(self, found: torch.Tensor, step_losses: StepLosses) -> None:
        params = self._parameters()
        # integer losses or norms (a frame count) are finite by nature, and the check takes floats only
        tensors = [t for t in (*step_losses.sums, *step_losses.norms) if t.is_floating_point()]
        # the fused op reads every tensor as the first one's dtype (on CUDA a mix is misread, silently):
        # one call when all share the parameters' dtype (the usual case), else one call per dtype
        one_dtype = self._param_dtype is not None and all(t.dtype == self._param_dtype for t in tensors)
        # with a float16 GradScaler, inf gradients are expected: the scaler skips those steps itself
        if self.engine.grad_scaler is None:
            tensors += filter(_is_tensor, map(_grad_of, params))  # (C loops: no Python line per parameter)
        if not tensors or self._one is None:
            return
        for group in [tensors] if one_dtype else _by_dtype(tensors):
            try:
                # scale 1: multiplying by 1.0 changes no value; the op only sets ``found`` on a NaN/Inf
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, self._one)
            except RuntimeError:  # tensors on several devices: each one checked on the flag's device
                for t in group:
                    torch._amp_foreach_non_finite_check_and_unscale_([t.to(found.device)], found, self._one)

    def _parameters(self) -> list[torch.nn.Parameter]:
        if self._params is None:
            self._params = self.engine.built_updater.parameters()
            dtypes = {p.dtype for p in self._params}
            self._param_dtype = dtypes.pop() if len(dtypes) == 1 else None
        return self._params

    def end_step(self) -> None:
        """After the step (deferred mode): the RNG state the next step starts from."""
        if self._records and self._records[-1].rng_after is None:
            self._records[-1].rng_after = rng.snapshot() if self._host_rng_used else rng.torch_rng_state()

    def account(self, step_losses: StepLosses) -> None:
        """Add a step's losses to the epoch sums; deferred mode adds them once the flag was read."""
        if self._live != "deferred":
            self.engine.accounting.add(step_losses)

    def step_optimizer(self, step: Callable[[], object]) -> None:
        """Run the optimizer step; deferred mode makes it a no-op on the device once the flag is set."""
        if self._live != "deferred" or self._found is None:
            step()  # immediate: a bad micro-batch was reported before any update
            return
        optimizer: Any = self.engine.built_updater.optimizer  # Any: found_inf / grad_scale are GradScaler's duck typing
        if optimizer.defaults.get("fused") and self.engine.grad_scaler is None:
            optimizer.found_inf, optimizer.grad_scale = self._found, None  # GradScaler's interface
            try:
                step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale
            return
        self._where_step(optimizer, step, self._found)

    def _where_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], object], found: torch.Tensor) -> None:
        # torch's optimizers update their state tensors in place: the list changes only when state is added
        if len(optimizer.state) != self._opt_state_len or len(self._opt_backup) != len(self._opt_live):
            tensors = self._state_tensors(optimizer)
            # e.g. non-capturable Adam's step counters stay on the CPU beside CUDA parameters: no select
            # against a device flag there; a host copy per update, put back at the read instead
            self._opt_live = [t for t in tensors if t.device == found.device]
            self._opt_host = [t for t in tensors if t.device != found.device]
            self._opt_backup = [t.detach().clone() for t in self._opt_live]
            self._opt_state_len = len(optimizer.state)
        else:
            torch._foreach_copy_(self._opt_backup, self._opt_live)
        if self._opt_host:
            self._host_log.append((len(self._records), self._opt_host, [t.clone() for t in self._opt_host]))
        known = len(optimizer.state)
        step()
        with torch.no_grad():
            bad = torch.ne(found, 0)
            for now, before in zip(self._opt_live, self._opt_backup):
                torch.where(bad, before, now, out=now)
        if len(optimizer.state) != known:  # state made by this update: gone again if it was a bad one
            created = list(optimizer.state)[known:]
            self._new_state.append((found.clone(), created))

    @staticmethod
    def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = [t for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        return [p.data for p in params] + state

    # ---- module buffers (BatchNorm statistics) --------------------------------------------

    def _model_buffers(self) -> list[torch.Tensor]:
        if self._buffers is None:
            self._buffers = list(self.engine.built_model.buffers())
            self._buffer_backup = [b.detach().clone() for b in self._buffers]
        return self._buffers

    def _keep_buffers(self, bad: bool) -> None:
        buffers = self._model_buffers()
        if buffers and bad:  # the bad forward's statistics go; the backup is from before it
            torch._foreach_copy_(buffers, self._buffer_backup)

    def _keep_buffers_on_device(self, found: torch.Tensor) -> None:
        buffers = self._model_buffers()
        if buffers:
            bad = torch.ne(found, 0)
            for now, kept in zip(buffers, self._buffer_backup):  # the backup stops following at a bad step
                torch.where(bad, kept, now, out=kept)

    # ---- reading the flag -------------------------------------------------------------------

    @contextlib.contextmanager
    def deferred_reads(self) -> Iterator[None]:
        """A driver's ``train_*`` call: steps inside do not read; the flag is read when it ends."""
        self._depth += 1
        try:
            yield
        except Exception:
            self._depth -= 1
            if self._depth == 0:
                self.check()  # a bad step before the error comes first (the error is its context)
            raise
        except BaseException:  # an interrupt: the next read reports a bad step, the state stays as it is
            self._depth -= 1
            raise
        self._depth -= 1
        if self._depth == 0:
            self.check()

    def step_returned(self) -> None:
        """The end of ``Engine.train_step``: a bare call (outside any driver's call) reads the flag."""
        if self._depth == 0:
            self.check()

    def check(self) -> None:
        """A read point (deferred mode): one read of the flag; rewind and report when it is set."""
        if not self._records:
            return
        records, self._records = self._records, []
        flags = torch.stack([r.flag for r in records])
        first = None
        if bool(flags.any()):  # the deferred mode's one read (a second one only after a NaN/Inf)
            first = int(flags.nonzero()[0, 0])
        good = records if first is None else records[:first]
        for record in good:
            self.engine.accounting.add(record.step_losses)
        host_rng_kept = self._host_rng_used or _same_host_rng(self._host_rng_start, _host_rng())
        self._host_rng_used = not host_rng_kept or self._host_rng_used
        new_state, self._new_state = self._new_state, []
        host_log, self._host_log = self._host_log, []
        if first is not None:
            self._rewind(records[first], new_state)
            _put_back_host_state(host_log, first)
            if not host_rng_kept:
                logger.warning("numpy's or Python's global RNG was drawn from during the %d undone step(s): "
                               "it is not put back to where it stood after the bad step (torch's RNG is)",
                               len(records) - first - 1)
            self._report(records[first].batch, records[first].step_losses, records[first].rng_before,
                         later=len(records) - first - 1)

    def _rewind(self, record: _StepRecord, new_state: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
        """Back to right after the bad micro-batch: buffers, new optimizer state, counters, data, RNG."""
        engine = self.engine
        if self._model_buffers():
            torch._foreach_copy_(self._model_buffers(), self._buffer_backup)
        for flag, params in new_state:
            if bool(flag):  # read at a read point: the state was made by a skipped update
                for p in params:
                    engine.built_updater.optimizer.state.pop(p, None)
        engine.progress.load_state_dict(vars(record.progress))
        engine.progress.steps_exhausted = False
        batch, pipeline = record.batch, engine.train_pipeline
        position = getattr(batch, "batch_idx", None)
        if pipeline is not None and position is not None:
            state = pipeline.state_dict()
            if state["position"] != position + 1:
                pipeline.load_state_dict({**state, "epoch": batch.epoch, "position": position + 1})
        if record.rng_after is not None:
            restore_rng(record.rng_after)

    # ---- the report ---------------------------------------------------------------------------

    def _report(self, batch: Batch, step_losses: StepLosses, rng_before: RngState | None, *, later: int = 0) -> bool:
        """Drop the window, tell the events and the debugger, then skip (False) or raise."""
        engine, p = self.engine, self.engine.progress
        bad = self._nonfinite_names(step_losses, named_grads=later == 0)
        engine.built_updater.zero_grad()
        self._flag().zero_()
        p.accum_count = 0  # the window with the bad micro-batch is dropped as a whole
        kept = "parameters, optimizer state and module buffers are as before it"
        when = f"; found {later} step(s) later, which were undone" if later else ""
        error = NonFiniteLossError(
            f"non-finite values at epoch {p.epoch}, step {p.step_in_epoch} (global step {p.global_train_step}): "
            f"{', '.join(bad)}; the update was not applied ({kept}){when}",
            epoch=p.epoch, step=p.step_in_epoch, nonfinite=bad, global_train_step=p.global_train_step)
        engine.events.emit("nonfinite", error=error, batch=batch)
        if engine.debugger is not None:
            engine.debugger.notify("nonfinite", error=error, batch=batch, step_losses=step_losses, rng=rng_before)
        if engine.config.typed_value("nonfinite_policy") == "skip":
            p.consec_skipped_updates += 1
            p.skipped_updates_in_epoch += 1
            limit = engine.config.int("num_allowed_consec_invalid_gradient_steps")
            if p.consec_skipped_updates <= limit:
                logger.warning("%s — skipped (%d in a row)", error, p.consec_skipped_updates)
                return False
            error.args = (f"{error.args[0]}; {p.consec_skipped_updates} non-finite updates in a row "
                          f"exceed num_allowed_consec_invalid_gradient_steps={limit}",)
        raise error

    def _nonfinite_names(self, step_losses: StepLosses, *, named_grads: bool) -> list[str]:
        bad = [f"loss {name}" for name, v in step_losses.normalized().items() if not math.isfinite(v)]
        if self.engine.grad_scaler is not None:
            return bad or ["a loss's sum or norm"]
        if not named_grads:  # deferred: the gradients of that micro-batch are gone
            return bad or ["the gradients (which ones is not kept in deferred mode; session.replay() finds the op)"]
        grads = [f"gradient of {n}" for n, prm in self.engine.built_model.named_parameters()
                 if prm.grad is not None and not torch.isfinite(prm.grad).all()]
        return bad + grads[:_MAX_NAMED_GRADS] if bad or grads else ["a loss's sum or norm"]


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _put_back_host_state(host_log: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]], first: int) -> None:
    """Host-side optimizer state as before the first update that came after the bad micro-batch."""
    for records_before, tensors, values in host_log:
        if records_before > first:  # this update closed the window of the bad micro-batch (or a later one)
            torch._foreach_copy_(tensors, values)
            return


def restore_rng(snapshot: tuple) -> None:
    """Put back a step record's RNG: every global RNG (``rng.snapshot``), or torch's only."""
    if len(snapshot) == 4:
        rng.restore(snapshot)
        return
    torch.set_rng_state(snapshot[0])
    if snapshot[1] is not None:
        torch.cuda.set_rng_state_all(snapshot[1])


def _host_rng() -> tuple:
    import random

    import numpy as np

    return np.random.get_state(), random.getstate()


def _same_host_rng(a: tuple | None, b: tuple) -> bool:
    if a is None:
        return True
    (np_a, py_a), (np_b, py_b) = a, b
    return bool(py_a == py_b and np_a[0] == np_b[0] and np_a[2:] == np_b[2:] and (np_a[1] == np_b[1]).all())


def check_learning_rate(lr: float, source: str, where: str) -> None:
    """A NaN/Inf learning rate never reaches the optimizer (a host float: no read)."""
    if not math.isfinite(lr):
        raise ConfigError(f"{source} gave the learning rate {lr} at {where}; expected a finite number "
                          "(the update was not applied)")
