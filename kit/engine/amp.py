"""The step's float dtypes: automatic mixed precision (``torch_amp`` / ``grad_scaler``) and RETURNN's
``default_float_dtype`` (the model, the batches' float tensors and torch's default dtype in a step)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kit.config import Config
from kit.errors import ConfigError

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def amp_dtype(config: Config) -> torch.dtype | None:
    spec = config.typed_value("torch_amp")
    if not spec:
        return None
    name = spec["dtype"] if isinstance(spec, dict) else spec
    return _DTYPES[name]


def default_float_dtype(config: Config) -> torch.dtype | None:
    """``default_float_dtype`` as a torch dtype (the registry admits float16/bfloat16/float32/float64 only);
    None when unset (torch's own default, float32)."""
    name = config.typed_value("default_float_dtype")
    return None if name is None else getattr(torch, name)


def cast_to_default_float_dtype(model: torch.nn.Module, config: Config) -> torch.dtype | None:
    """The model's floating-point parameters and buffers in ``default_float_dtype`` (when set); that dtype."""
    dtype = default_float_dtype(config)
    if dtype is not None:
        model.to(dtype=dtype)
    return dtype


def default_dtype(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch's default dtype set to ``dtype`` inside the block, as before after it; a no-op for None
    (a step's usual case: no generator made per step)."""
    return contextlib.nullcontext() if dtype is None else _default_dtype(dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for the device, or a no-op when AMP is off."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(config: Config, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler only for float16 by default.

    RETURNN also enables it for bfloat16, which has float32's range and needs no loss
    scaling; kit does not. ``grad_scaler`` (dict of GradScaler kwargs, True, or False)
    overrides the default either way.
    """
    dtype = amp_dtype(config)
    spec: Any = config.typed_value("grad_scaler")
    amp_spec = config.typed_value("torch_amp")
    if isinstance(amp_spec, dict) and "grad_scaler" in amp_spec:
        spec = amp_spec["grad_scaler"]
    if spec is None:
        spec = dtype is torch.float16
    if spec is False:
        return None
    kwargs = spec if isinstance(spec, dict) else {}
    if not isinstance(spec, (bool, dict)):
        raise ConfigError(f"config key 'grad_scaler': got {spec!r}, expected True, False or a dict of GradScaler options")
    try:
        return torch.amp.GradScaler(device.type, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"config key 'grad_scaler': {exc}") from None
