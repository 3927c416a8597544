"""The ``optimizer`` config checked against the optimizer's own signature, before training starts.

``{"class": "adam", "betas": 0.9}`` or ``{"class": "sgd", "momentum": "0.9"}`` would fail deep
inside torch with a bare ``TypeError``; an unknown class name would only show at the first train
call. :func:`check_optimizer` reports all of it as one :class:`~kit.errors.ConfigError` naming
``optimizer`` at set-up. Types are judged by the signature's defaults (a float default wants a
number, a tuple default a sequence of that length, a bool default a bool).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kit.config import Config
from kit.errors import ConfigError


def resolve_dotted(name: str, what: str) -> Any:
    """Import ``"pkg.mod.Attr"`` (no eval)."""
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot import {name!r} ({exc})") from None


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Lower-case name -> class for every optimizer in ``torch.optim``."""
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }


def resolve_optimizer_class(spec: Any) -> type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer]:
    """An optimizer class (by torch.optim name, case-insensitive, dotted path or type) or a factory."""
    if isinstance(spec, str):
        if "." in spec:
            spec = resolve_dotted(spec, "config key 'optimizer'")
        else:
            classes = optimizer_classes()
            if spec.lower() not in classes:
                raise ConfigError(
                    f"config key 'optimizer': unknown optimizer class {spec!r}; torch.optim has "
                    f"{', '.join(sorted(classes))} (or give a dotted path 'pkg.mod.Class', a class, or a factory)"
                )
            return classes[spec.lower()]
    if isinstance(spec, type):
        if not issubclass(spec, torch.optim.Optimizer):
            raise ConfigError(
                f"config key 'optimizer': {spec.__qualname__} is not a torch.optim.Optimizer subclass"
            )
        return spec
    if callable(spec):
        return spec
    raise ConfigError(
        f"config key 'optimizer': 'class' must be a name, a dotted path, a class or a factory, got {spec!r}"
    )


# options kit itself consumes from the optimizer dict (never passed to torch)
KIT_OPTIONS = ("class", "learning_rate_multiplier", "weight_decay_modules_blacklist",
               "weight_decay_custom_include_check", "param_groups_custom")


def check_optimizer(config: Config) -> None:
    """Raise one ConfigError listing every problem of the ``optimizer`` setting (unset: nothing to say)."""
    spec = config.typed_value("optimizer")
    if isinstance(spec, Mapping) and config.has("param_groups_custom"):  # the config-level form of the option
        spec = {**spec, "param_groups_custom": config.typed_value("param_groups_custom")}
    problems = optimizer_problems(spec)
    if problems:
        raise ConfigError(problems)


def optimizer_problems(spec: Any) -> list[str]:
    """What is wrong with an ``optimizer`` value: its class, its keywords, their types."""
    if spec is None or not isinstance(spec, Mapping):
        return []  # unset, a class or a factory: the updater says what it needs
    problems = [f"config key 'optimizer': no {k!r} inside 'optimizer'; set the config key 'learning_rate' instead"
                for k in ("lr", "learning_rate") if k in spec]
    if "class" not in spec:
        return [*problems, "config key 'optimizer': the dict needs a 'class' entry, e.g. {'class': 'adamw'}"]
    try:
        cls = resolve_optimizer_class(spec["class"])
    except ConfigError as e:
        return [*problems, *e.problems]
    if not isinstance(cls, type):
        return problems  # a factory: its own signature is its business
    kwargs = {k: v for k, v in spec.items() if k not in KIT_OPTIONS and k not in ("lr", "learning_rate")}
    if "epsilon" in kwargs and "eps" not in kwargs:
        kwargs["eps"] = kwargs.pop("epsilon")
    # with param_groups_custom, RETURNN hands the function these options: it may take its own out of them
    # (e.g. learning_rate_multipliers_by_patterns); the updater checks what is left after the call
    return problems + keyword_problems(cls, kwargs, unknown_ok="param_groups_custom" in spec)


def keyword_problems(cls: type, kwargs: Mapping[str, Any], *, unknown_ok: bool = False) -> list[str]:
    """What is wrong with the keywords ``kwargs`` for optimizer class ``cls`` (names it does not take, types
    that do not fit its defaults); ``unknown_ok``: judge only the names it takes."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return []
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    known = sorted(n for n, p in params.items() if n not in ("params", "lr") and p.kind is not p.VAR_KEYWORD)
    problems = []
    for name, value in kwargs.items():
        param = params.get(name)
        if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if not takes_any and not unknown_ok:
                problems.append(f"config key 'optimizer': {cls.__name__} does not accept {name!r}; "
                                f"it accepts {', '.join(known)}")
            continue
        expected = _type_problem(param.default, value)
        if expected:
            problems.append(f"config key 'optimizer': {name}={value!r} for {cls.__name__}, expected {expected} "
                            f"(its default is {param.default!r})")
    return problems


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or isinstance(v, torch.Tensor)


def _type_problem(default: Any, value: Any) -> str | None:
    """What ``value`` should be, judged by the parameter's default; None when it fits or cannot be judged."""
    if default is inspect.Parameter.empty or default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "True or False"
    if isinstance(default, (int, float)):
        return None if _is_number(value) else "a number"
    if isinstance(default, tuple):
        fits = isinstance(value, (tuple, list)) and len(value) == len(default) and all(map(_is_number, value))
        return None if fits else f"a tuple of {len(default)} numbers"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None
