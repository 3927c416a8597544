"""Device choice: ``PT_DEVICE`` env var, then the ``device`` config key, then cuda → mps → cpu."""

from __future__ import annotations

import os

import torch

from kit.errors import ConfigError


def select_device(requested: str | None) -> tuple[torch.device, str]:
    """The device to train on and the reason it was chosen (for the log)."""
    env = os.environ.get("PT_DEVICE")
    if env:
        return _resolve(env, source="environment variable PT_DEVICE"), f"PT_DEVICE={env!r}"
    if requested is None:
        if torch.cuda.is_available():
            return torch.device("cuda"), "device=None and CUDA is available"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps"), "device=None, no CUDA, MPS is available"
        return torch.device("cpu"), "device=None and neither CUDA nor MPS is available"
    return _resolve(requested, source="config key 'device'"), f"device={requested!r} in the config"


def _resolve(name: str, *, source: str) -> torch.device:
    if name == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{source}: got 'gpu', but no GPU is usable here ({_why_no_cuda()}); "
                "use device=None to fall back to the CPU, or 'cpu'"
            )
        return torch.device("cuda")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{source}: got {name!r}, expected 'cpu', 'gpu', 'cuda', 'cuda:N', 'mps' or 'meta'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{source}: got {name!r}, but CUDA is not usable here ({_why_no_cuda()})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{source}: got {name!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is a CPU-only build"
    return "torch.cuda.is_available() is False (no driver or no visible device)"
