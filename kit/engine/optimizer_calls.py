"""An optimizer's ``step`` and ``zero_grad``, without torch's profiling wrappers where nothing can tell.

torch wraps every optimizer class's ``step`` in ``Optimizer.profile_hook_step``: a profiler
range (``record_function``, two ``torch.ops`` calls: ~14 µs warm, ~50 µs a step inside the
MLP benchmark's training loop, where the model's compute has just evicted the caches) around
the global and per-optimizer step hooks and the class's own ``step``. ``zero_grad`` likewise
wraps its loop in a range and a compile guard (~15 µs). On a small model that is several
percent of a training step.

Where nobody can see the difference — no profiler recording, no step hook registered, no
``step`` patched onto the instance (as an LR scheduler of torch's does) — :func:`step` calls
the wrapped ``step`` itself and :func:`zero_grad` sets the gradients to None itself: the same
updates, the same gradients. Otherwise, and for anything that is not torch's wrapper (an
optimizer class with a ``step`` of its own making, a torch without these internals), they
call the optimizer's own methods.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

_profiling: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def _wrapper_code() -> CodeType | None:
    """The code of torch's step wrapper: every class's wrapped ``step`` runs this code object."""
    hook = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    return getattr(hook(lambda *a, **k: None), "__code__", None) if callable(hook) else None


_WRAPPER_CODE = _wrapper_code()  # a fact of the torch version (no state)


def unwrapped_step(cls: type) -> Callable[..., Any] | None:
    """The step that torch's wrapper of ``cls.step`` calls; None when ``cls.step`` is not that wrapper."""
    step = getattr(cls, "step", None)
    if _WRAPPER_CODE is None or getattr(step, "__code__", None) is not _WRAPPER_CODE:
        return None
    if not callable(getattr(cls, "_optimizer_step_code", None)):  # what the wrapper calls after the step
        return None
    return getattr(step, "__wrapped__", None)


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's wrapper would call a step hook (of this optimizer or global); True when unknown."""
    hooks = (
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
    )
    return None in hooks or any(map(len, hooks))  # type: ignore[arg-type]  # no None left; C loops


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, without the profiler range where nothing can tell (see the module)."""
    raw = unwrapped_step(type(optimizer))
    if raw is None or _profiling() or "step" in vars(optimizer) or has_step_hooks(optimizer):
        optimizer.step()
        return
    raw(optimizer)
    optimizer._optimizer_step_code()  # what the wrapper calls after the step (a profiler's Python tracing hooks it)


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Every gradient to None, as ``optimizer.zero_grad()`` does; kit's own loop unless the class has its
    own ``zero_grad`` or a profiler records (then its range shows in the trace, as without kit)."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad or "zero_grad" in vars(optimizer) or _profiling():
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
