"""Putting loaded weights into a model: in-place copy, ``preload_from_files``, ``load_model_post_hooks``."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kit.checkpoints.files import load
from kit.errors import CheckpointError, ConfigError

logger = logging.getLogger("kit")


def load_into_model(model: torch.nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Copy ``state_dict`` into ``model``'s own tensors (no second copy of the model on the device).

    Raises:
        CheckpointError: keys missing (``strict``) or shapes differ; unexpected keys are only logged.
    """
    targets = model.state_dict(keep_vars=True)
    missing = sorted(k for k, v in targets.items() if isinstance(v, torch.Tensor) and k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in targets)
    bad_shape = [
        f"{k}: file {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in targets.items()
        if k in state_dict
        and isinstance(v, torch.Tensor)
        and isinstance(state_dict[k], torch.Tensor)
        and state_dict[k].shape != v.shape
    ]
    if bad_shape:
        raise CheckpointError("Shape mismatch while loading into the model:\n  " + "\n  ".join(bad_shape))
    if missing and strict:
        raise CheckpointError(f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}")
    if missing:
        logger.info("Note: keys not in the loaded state (kept as they are): %s", ", ".join(missing))
    if unexpected:
        logger.info("Note: unexpected key(s) in state_dict (ignored): %s", ", ".join(map(repr, unexpected)))
    with torch.no_grad():
        for key, target in targets.items():
            if key in state_dict and isinstance(target, torch.Tensor):
                target.copy_(state_dict[key])


# ----------------------------------------------------------------------------------------------
# preload_from_files and load_model_post_hooks


def _preload_state(name: str, opts: Mapping[str, Any], model_keys: list[str]) -> tuple[dict, str]:
    """The file's state dict for one ``preload_from_files`` entry, renamed into the model's namespace."""
    filename = os.fspath(opts["filename"])
    state = load(filename)
    checkpoint_key = opts.get("checkpoint_key", "model")
    if checkpoint_key is not None and not filename.endswith(".safetensors"):
        if not isinstance(state, Mapping) or checkpoint_key not in state:
            raise CheckpointError(
                f"preload_from_files[{name!r}]: {filename} has no key {checkpoint_key!r}; "
                f"set checkpoint_key=None if the file is a plain state dict"
            )
        state = state[checkpoint_key]
    prefix = opts.get("prefix", "") or ""
    if prefix and not any(k.startswith(prefix) for k in model_keys):
        raise CheckpointError(
            f"preload_from_files[{name!r}]: prefix {prefix!r} matches no parameter of the model"
        )
    # RETURNN: file keys lack the prefix; they are loaded into the model's params under it.
    state = {prefix + k: v for k, v in state.items()}
    ignore, ignore_prefixes = (
        set(opts.get("ignore_params", ())),
        tuple(opts.get("ignore_params_prefixes", ())),
    )
    for key in [k for k in state if k in ignore or (ignore_prefixes and k.startswith(ignore_prefixes))]:
        logger.info("preload_from_files[%r]: ignoring %s", name, key)
        del state[key]
    for new_name, file_name in dict(opts.get("var_name_mapping", {})).items():
        src = file_name if file_name in state else prefix + file_name
        if src not in state:
            raise CheckpointError(
                f"preload_from_files[{name!r}]: var_name_mapping source {file_name!r} is not in {filename}"
            )
        state[new_name] = state.pop(src)
    return state, prefix


def preload_from_files(
    model: torch.nn.Module, preload: Mapping[str, Mapping[str, Any]], *, is_training_start: bool = True
) -> list[str]:
    """RETURNN's ``preload_from_files``: fill (parts of) ``model`` from other files; returns loaded names.

    Entries with ``init_for_train=True`` apply only at training start; the others (RETURNN's
    default) only outside training (``is_training_start=False``: eval, forward, search). On resumed
    training nothing is preloaded — the checkpoint holds the weights — so do not call this then.
    Entries are applied in reverse-sorted name order, so the first name wins (as in RETURNN).
    """
    targets = model.state_dict(keep_vars=True)
    model_keys = [k for k, v in targets.items() if isinstance(v, torch.Tensor)]
    loaded: set[str] = set()
    missing: dict[str, set[str]] = {}
    for name, opts in reversed(sorted(preload.items())):
        if not isinstance(opts, Mapping) or "filename" not in opts:
            raise ConfigError(f"preload_from_files[{name!r}] must be a dict with a 'filename'")
        if bool(opts.get("init_for_train", False)) != is_training_start:
            logger.info(
                "preload_from_files[%r] skipped (init_for_train=%s, training start=%s)",
                name,
                opts.get("init_for_train", False),
                is_training_start,
            )
            continue
        logger.info("Pre-load weights for key %r from %s", name, opts["filename"])
        state, prefix = _preload_state(name, opts, model_keys)
        unexpected = sorted(k for k in state if k not in targets)
        if unexpected:
            logger.info(
                "Note: while loading preload_from_files[%r] (%s), unexpected key(s): %s",
                name,
                opts["filename"],
                ", ".join(map(repr, unexpected)),
            )
        present = {k: v for k, v in state.items() if k in targets}
        load_into_model(model, present, strict=False)
        loaded.update(present)
        relevant = {k for k in model_keys if k.startswith(prefix)} - set(present)
        if relevant and not opts.get("ignore_missing", False):
            missing[name] = relevant
    still_missing = {n: sorted(ks - loaded) for n, ks in missing.items() if ks - loaded}
    if still_missing:
        raise CheckpointError(
            "preload_from_files: missing key(s) in state_dict:\n"
            + "\n".join(
                f"  {n} ({preload[n]['filename']}): {', '.join(map(repr, ks))}"
                for n, ks in still_missing.items()
            )
            + "\nSet 'ignore_missing': True in the entry to keep those parameters as initialized."
        )
    return sorted(loaded)


def apply_load_model_post_hooks(model: torch.nn.Module, hooks: Iterable[Callable] | Callable | None) -> None:
    """Call each ``hook(*, model, **kwargs)`` (RETURNN's ``load_model_post_hooks``) after loading."""
    if hooks is None:
        return
    hooks = [hooks] if callable(hooks) else list(hooks)
    for hook in hooks:
        try:
            params = inspect.signature(hook).parameters.values()
        except (TypeError, ValueError):
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
            raise ConfigError(
                f"load_model_post_hooks: {getattr(hook, '__qualname__', hook)!r} must accept "
                f"**kwargs, e.g. def {getattr(hook, '__name__', 'hook')}(*, model, **_): ..."
            )
    for hook in hooks:
        # an extra keyword (RETURNN passes a random one) keeps hooks forward compatible; not drawn
        # from `random`, which would shift the training RNG
        hook(model=model, **{f"_fwd_compatible_arg_{os.getpid() % 100}": None})
