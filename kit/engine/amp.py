"""Automatic mixed precision from the ``torch_amp`` / ``grad_scaler`` config keys."""

from __future__ import annotations

import contextlib
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
