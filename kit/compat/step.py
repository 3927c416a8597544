"""RETURNN-style user functions (``train_step``, ``forward_step``, ``get_model``) adapted at the config boundary.

:func:`adapt_function` wraps a function whose module uses RETURNN (its globals hold ``returnn``
modules or classes) so that, when kit calls it:

- without RETURNN installed, ``extern_data`` is a :class:`kit.compat.tensor.TensorDict` view of
  kit's batch and ``rf.get_run_ctx()`` is kit's run context in RETURNN's forms;
- with RETURNN installed, ``extern_data`` is a real ``returnn.tensor.TensorDict`` built by RETURNN's
  own ``raw_dict_to_extern_data`` from the config's ``extern_data``, RETURNN's run context is set up
  for the step as RETURNN's engine does, and its marked losses and outputs are handed to kit's run
  context afterwards; ``get_model`` may return an ``rf.Module``, converted with RETURNN's own
  ``rf_module_to_pt_module``.

The engine only ever sees a plain callable taking kit's keyword arguments.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

from kit.compat.imports import is_fallback_module, returnn_imports
from kit.compat.tensor import batch_view
from kit.engine.user_code import keyword_names
from kit.run_ctx import get_run_ctx

ADAPTED_ATTR = "__kit_returnn_adapted__"
STEP_KEYS = ("train_step", "forward_step")


def uses_returnn(fn: Any) -> bool:
    """Whether ``fn``'s module globals hold something from RETURNN (or kit's stand-in for it)."""
    namespace = getattr(fn, "__globals__", None)
    if namespace is None:
        namespace = getattr(getattr(fn, "__func__", None), "__globals__", None)
    if not isinstance(namespace, Mapping):
        return False
    return any(_is_returnn_object(v) for v in list(namespace.values()))


def _is_returnn_object(value: Any) -> bool:
    if isinstance(value, types.ModuleType):
        return value.__name__ == "returnn" or value.__name__.startswith("returnn.") or is_fallback_module(value)
    module = getattr(value, "__module__", None)
    if not isinstance(module, str):
        return False
    return module.startswith("returnn.") or module.startswith("kit.compat.")


def adapt_function(key: str, fn: Any, spec: Mapping[str, Any]) -> Any:
    """``fn`` wrapped for kit when it is RETURNN-style (see the module docstring), else ``fn`` itself.

    ``spec`` holds the config's ``extern_data`` and ``model_outputs`` as written for RETURNN.
    """
    if not callable(fn) or getattr(fn, ADAPTED_ATTR, False) or not uses_returnn(fn):
        return fn
    if key == "get_model":
        wrapper = _get_model_wrapper(fn)
    elif key in STEP_KEYS:
        wrapper = _step_wrapper(fn, dict(spec))
    else:
        return fn
    setattr(wrapper, ADAPTED_ATTR, True)
    # RETURNN calls forward_step(model=, extern_data=) only, so it may lack **kwargs; the wrapper takes them
    wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    )
    return wrapper


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (all of them when it has ``**kwargs``)."""
    names = keyword_names(fn)
    return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}


def _get_model_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def get_model(**kwargs: Any) -> Any:
        with returnn_imports() as fallback:
            if not fallback:
                _select_rf_backend()
            model = fn(**_accepted(fn, kwargs))
            return model if fallback else _as_torch_module(model)

    return get_model


def _step_wrapper(fn: Callable[..., Any], spec: dict[str, Any]) -> Callable[..., Any]:
    bridge: list[Any] = []  # the RETURNN bridge, created on first use (needs RETURNN imported)

    @functools.wraps(fn)
    def step(*, model: Any, extern_data: Any, **kwargs: Any) -> Any:
        kwargs = _accepted(fn, kwargs)
        with returnn_imports() as fallback:
            if fallback:
                return fn(model=model, extern_data=batch_view(extern_data), **kwargs)
            if not bridge:
                from kit.compat.bridge import ReturnnBridge

                bridge.append(ReturnnBridge(spec.get("extern_data"), spec.get("model_outputs")))
            return bridge[0].run(fn, model=model, batch=extern_data, ctx=get_run_ctx(), **kwargs)

    return step


def _select_rf_backend() -> None:
    import returnn.frontend as rf  # type: ignore[import]

    rf.select_backend_torch()


def _as_torch_module(model: Any) -> Any:
    import returnn.frontend as rf  # type: ignore[import]

    if isinstance(model, rf.Module):
        from returnn.torch.frontend.bridge import rf_module_to_pt_module  # type: ignore[import]

        return rf_module_to_pt_module(model)
    return model
