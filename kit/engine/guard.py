"""``NonFiniteGuard``: no update from a NaN/Inf loss or gradient, and no host read per step where reads cost.

After every micro-batch's backward, its losses and the (accumulated, not yet clipped) gradients
go through one exact finite check that ORs into a sticky device flag (:func:`any_nonfinite`).
When the flag is read is ``nonfinite_check``:

* ``"immediate"`` (``"auto"`` on a CPU device, where the flag is host memory and reading it
  costs no sync; always under ``nonfinite_policy="skip"`` and under torchrun): after each
  micro-batch. A bad one is reported at once, before any update: its window is dropped, the
  BatchNorm statistics its forward changed are put back, and it raises (or is skipped and counted).
* ``"deferred"`` (``"auto"`` on an accelerator): never per step. The flag is read where the host
  reads losses anyway — log lines, checkpoints, the epoch end and the end of a ``train_*`` call.
  When it is found set, the engine puts back its training-state snapshot from before the first
  step since the last read (a *mark*, kept on the device: one copy of the weights and optimizer
  state, as a where-select of the update would need too) and trains those steps again in
  immediate mode, which reports the bad micro-batch exactly as immediate mode would have. The one
  undo mechanism (:class:`kit.engine.state.TrainingState`) is the rewind, so the session stands
  as if the later steps had never run. The steps trained again are the same batches with the same
  RNG; a step whose NaN/Inf does not come back (a non-deterministic kernel, user code that
  counts its calls) ends in an error that says so.

The report is the same in both modes: ``NonFiniteLossError`` naming the micro-batch and its
non-finite losses and gradients, the ``nonfinite`` event (the debugger listens), and under
``nonfinite_policy="skip"`` a warning and a counted skip instead of the error.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kit.engine.accounting import StepLosses
from kit.errors import ConfigError, NonFiniteLossError
from kit.events import Events, NonFinite

if TYPE_CHECKING:
    from kit.config import Config
    from kit.data.batch import Batch
    from kit.engine.progress import Progress
    from kit.engine.state import TrainingState
    from kit.rng import RngState

logger = logging.getLogger("kit")

_MAX_NAMED_GRADS = 20


@dataclass(frozen=True)
class GuardOptions:
    """What the guard reads from the config, once per config version."""

    enabled: bool  # stop_on_nonfinite_train_score
    mode: str  # "immediate" or "deferred" (``nonfinite_check`` resolved for the device)
    skip: bool  # nonfinite_policy="skip"
    allowed_in_a_row: int  # num_allowed_consec_invalid_gradient_steps

    @classmethod
    def read(cls, config: Config, *, accelerator: bool, distributed: bool) -> GuardOptions:
        wanted, skip = config.typed_value("nonfinite_check"), config.typed_value("nonfinite_policy") == "skip"
        if wanted == "deferred" and skip:
            raise ConfigError("config key 'nonfinite_check': 'deferred' cannot be combined with "
                              "nonfinite_policy='skip' (a skipped step is counted and training goes on at "
                              "once, which needs the flag after every micro-batch); use 'immediate' or 'auto'")
        if wanted == "auto":  # under torchrun each rank has its own flag: ranks must not disagree on an update
            wanted = "deferred" if accelerator and not skip and not distributed else "immediate"
        return cls(bool(config.bool("stop_on_nonfinite_train_score")), str(wanted), skip,
                   config.int("num_allowed_consec_invalid_gradient_steps"))


class Rewinder(Protocol):
    """What deferred mode needs of its engine: a snapshot, putting it back, and training steps again."""

    def capture(self, *, on_device: bool = False) -> TrainingState: ...

    def restore_state(self, state: TrainingState) -> None: ...

    def retrain(self, steps: int) -> None: ...


def any_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool device tensor: does any element of ``tensors`` hold a NaN or an Inf? Exact (no overflow:
    the largest and smallest elements are finite exactly when all are; NaN propagates through both)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).extend((t.amax(), t.amin()))
    # stacked per dtype (a cast could turn a large finite float64 into an inf): one check per dtype
    finite = [torch.stack(extremes).isfinite().all() for extremes in by_dtype.values()]
    return ~(finite[0] if len(finite) == 1 else torch.stack(finite).all())


class NonFiniteGuard:
    """The engine's non-finite guard; the step calls :meth:`begin_step` and :meth:`check`."""

    def __init__(self, model: torch.nn.Module, params: Callable[[], list[torch.nn.Parameter]],
                 zero_grad: Callable[[], None], events: Events, *, checks_gradients: bool):
        self.model, self.params, self.zero_grad, self.events = model, params, zero_grad, events
        self.checks_gradients = checks_gradients  # False with a float16 GradScaler: it skips inf steps itself
        self.options = GuardOptions(True, "immediate", False, 0)
        self._found: torch.Tensor | None = None  # 0-d bool flag, sticky until a read
        self._flags: list[torch.Tensor] = []  # deferred: the flag after each step since the mark
        self._mark: TrainingState | None = None
        self._buffers = list(model.buffers())
        self._backup: list[torch.Tensor] = []
        self._replaying = False
        self._silent = False  # probes: a bad one raises without telling the bus

    # ---- configuration ------------------------------------------------------------------

    def configure(self, options: GuardOptions) -> None:
        """New options (the config changed); steps not read yet are read by the engine first."""
        self.options = options

    @property
    def deferred(self) -> bool:
        return self.options.mode == "deferred" and not self._replaying

    @property
    def pending(self) -> bool:
        """Deferred steps whose flag was not read yet."""
        return bool(self._flags)

    # ---- the step's hooks ---------------------------------------------------------------

    def begin_step(self, rewinder: Rewinder) -> None:
        """Before the step's forward: immediate mode backs up the module buffers (BatchNorm statistics)
        a bad forward would change; deferred mode takes its mark when it has none."""
        if not self.options.enabled:
            return
        if self.deferred:
            if self._mark is None:
                self._mark = rewinder.capture(on_device=True)
            return
        if self._buffers:
            if not self._backup:
                self._backup = [b.detach().clone() for b in self._buffers]
            else:
                for kept, now in zip(self._backup, self._buffers):
                    kept.copy_(now)

    def check(self, losses: StepLosses, progress: Progress, batch: Batch, rng: RngState | None) -> bool:
        """This micro-batch's losses and the window's gradients, checked: True when finite (deferred mode:
        not read now). Immediate mode reports a bad one (:meth:`report`): it raises, or under
        ``nonfinite_policy="skip"`` returns False with the window dropped."""
        if not self.options.enabled:
            return True
        tensors = [t for t in (*losses.sums, *losses.norms) if t.is_floating_point()]
        if self.checks_gradients:
            tensors += [p.grad for p in self.params() if p.grad is not None]
        if not tensors:
            return True
        bad = any_nonfinite(tensors)
        if self.deferred:
            self._found = bad if self._found is None else self._found | bad  # sticky since the last read
            self._flags.append(self._found)
            return True
        if not bool(bad):  # immediate mode's read: host memory on a CPU device (no sync)
            return True
        self.report(progress, batch, losses, rng)
        return False

    def report(self, progress: Progress, batch: Batch, losses: StepLosses, rng: RngState | None) -> None:
        """The micro-batch just checked was bad (immediate): put back its buffers, drop its gradients,
        tell the bus; then raise, or return under ``nonfinite_policy="skip"`` (the caller counts it)."""
        for now, kept in zip(self._buffers, self._backup):
            now.copy_(kept)
        bad = self._nonfinite_names(losses)
        self.zero_grad()
        kept_what = "parameters, optimizer state and module buffers are as before it"
        error = NonFiniteLossError(
            f"non-finite values at epoch {progress.epoch}, step {progress.step_in_epoch} (global step "
            f"{progress.global_train_step}): {', '.join(bad)}; the update was not applied ({kept_what})",
            epoch=progress.epoch, step=progress.step_in_epoch, nonfinite=bad,
            global_train_step=progress.global_train_step)
        progress.window_dropped(skipped=self.options.skip)  # the window with the bad micro-batch goes as a whole
        if not self._silent:
            self.events.emit(NonFinite(error, batch, losses, rng))
        if not self.options.skip:
            raise error
        limit = self.options.allowed_in_a_row
        if progress.consec_skipped_updates > limit:
            error.args = (f"{error.args[0]}; {progress.consec_skipped_updates} non-finite updates in a row "
                          f"exceed num_allowed_consec_invalid_gradient_steps={limit}",)
            raise error
        logger.warning("%s — skipped (%d in a row)", error, progress.consec_skipped_updates)

    # ---- deferred mode: reading the flag ---------------------------------------------------

    def read(self, rewinder: Rewinder) -> None:
        """A read point: one read of the flag. Set → back to the mark and train again in immediate mode
        (which reports the bad micro-batch); clean → the next deferred step takes a new mark."""
        if not self._flags:
            return
        flags, self._flags, self._found = self._flags, [], None
        if not bool(flags[-1]):  # the deferred mode's one read (sticky: the last flag says it all)
            self._mark = None
            return
        first_bad = int(torch.stack(flags).nonzero()[0, 0])  # (a second read only after a NaN/Inf)
        mark = self._mark
        assert mark is not None, "a deferred step ran without a mark"
        self._mark = None
        rewinder.restore_state(mark)
        with self.replaying():
            rewinder.retrain(first_bad + 1)  # the good steps again, then the bad one, which reports
        raise NonFiniteLossError(  # trained again, the bad step was finite: the step is not deterministic
            f"a non-finite loss or gradient was found within {len(flags)} steps after the global step "
            f"{mark.progress.global_train_step}, but training those steps again from there gave finite "
            "values (the steps are not deterministic); the state is that of training them again",
            epoch=mark.progress.epoch, step=mark.progress.step_in_epoch, nonfinite=[],
            global_train_step=mark.progress.global_train_step)

    def epoch_boundary(self) -> None:
        """An epoch ended (after its read): the next epoch's first deferred step takes a fresh mark."""
        self._mark, self._flags, self._found = None, [], None

    def forget(self) -> None:
        """The training state was put back from elsewhere (a restore): nothing recorded still holds."""
        self.epoch_boundary()

    @property
    def retraining(self) -> bool:
        """Steps are being trained again after a rewind (immediate mode, no step checkpoints)."""
        return self._replaying

    @contextlib.contextmanager
    def replaying(self, *, silent: bool = False) -> Iterator[None]:
        """Immediate mode inside the block (a rewind's steps trained again; ``silent``: the LR finder's
        probes, whose non-finite losses end the sweep without reaching the bus)."""
        self._replaying, self._silent = True, silent
        try:
            yield
        finally:
            self._replaying = self._silent = False

    def _nonfinite_names(self, losses: StepLosses) -> list[str]:
        bad = [f"loss {name}" for name, v in losses.normalized().items() if not math.isfinite(v)]
        if not self.checks_gradients:
            return bad or ["a loss's sum or norm"]
        grads = [f"gradient of {n}" for n, prm in self.model.named_parameters()
                 if prm.grad is not None and not torch.isfinite(prm.grad).all()]
        return bad + grads[:_MAX_NAMED_GRADS] if bad or grads else ["a loss's sum or norm"]


def check_learning_rate(lr: float, source: str, where: str) -> None:
    """A NaN/Inf learning rate never reaches the optimizer (a host float: no read)."""
    if not math.isfinite(lr):
        raise ConfigError(f"{source} gave the learning rate {lr} at {where}; expected a finite number "
                          "(the update was not applied)")

