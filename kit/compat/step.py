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

from kit.compat.global_config import ReturnnGlobals
from kit.compat.imports import is_fallback_module, returnn_imports
from kit.compat.seeding import apply_pending_seed
from kit.compat.tensor import batch_view
from kit.run_ctx import get_run_ctx
from kit.signatures import keyword_names

ADAPTED_ATTR = "__kit_returnn_adapted__"
STEP_KEYS = ("train_step", "forward_step")


def uses_returnn(fn: Any) -> bool:
    """Whether ``fn`` is RETURNN-style: its module globals hold something from RETURNN (or kit's
    stand-in for it), or its code (or a function of its module that it calls) imports ``returnn``.

    So the batch a step function gets does not depend on where its config imports RETURNN.
    """
    fn = getattr(fn, "__func__", fn)
    namespace = getattr(fn, "__globals__", None)
    if not isinstance(namespace, Mapping):
        return False
    if any(_is_returnn_object(v) for v in list(namespace.values())):
        return True
    code = getattr(fn, "__code__", None)
    return isinstance(code, types.CodeType) and _imports_returnn(code, namespace, set())


def _imports_returnn(code: types.CodeType, namespace: Mapping[str, Any], seen: set[int]) -> bool:
    """Whether ``code`` (its nested code, or a module-level function it names) imports ``returnn``."""
    if id(code) in seen:
        return False
    seen.add(id(code))
    for name in code.co_names:
        if name == "returnn" or name.startswith("returnn."):
            return True
        called = namespace.get(name)
        inner = getattr(called, "__code__", None)
        if isinstance(inner, types.CodeType) and getattr(called, "__globals__", None) is namespace:
            if _imports_returnn(inner, namespace, seen):
                return True
    return any(isinstance(c, types.CodeType) and _imports_returnn(c, namespace, seen) for c in code.co_consts)


def _is_returnn_object(value: Any) -> bool:
    if isinstance(value, types.ModuleType):
        return value.__name__ == "returnn" or value.__name__.startswith("returnn.") or is_fallback_module(value)
    module = getattr(value, "__module__", None)
    if not isinstance(module, str):
        return False
    return module.startswith("returnn.") or module.startswith("kit.compat.")


def adapt_function(key: str, fn: Any, spec: Mapping[str, Any]) -> Any:
    """``fn`` wrapped for kit when it is RETURNN-style (see the module docstring), else ``fn`` itself.

    ``spec`` holds the config's ``extern_data`` and ``model_outputs`` as written for RETURNN, and the
    :class:`~kit.compat.global_config.ReturnnGlobals` of its values (``returnn_globals``), one per config.
    """
    if not callable(fn) or getattr(fn, ADAPTED_ATTR, False) or not uses_returnn(fn):
        return fn
    if key == "get_model":
        wrapper = _get_model_wrapper(fn, dict(spec))
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


def _globals_of(spec: dict[str, Any]) -> ReturnnGlobals:
    """The config's one :class:`ReturnnGlobals` (shared by its get_model and step functions)."""
    found = spec.get("returnn_globals")
    return found if isinstance(found, ReturnnGlobals) else ReturnnGlobals({})


def _get_model_wrapper(fn: Callable[..., Any], spec: dict[str, Any]) -> Callable[..., Any]:
    globals_ = _globals_of(spec)

    @functools.wraps(fn)
    def get_model(**kwargs: Any) -> Any:
        with returnn_imports() as fallback:
            if fallback:
                return fn(**_accepted(fn, kwargs))
            with globals_.active():
                _select_rf_backend()
                apply_pending_seed()  # a config that imports returnn only inside get_model
                return _as_torch_module(fn(**_accepted(fn, kwargs)))

    return get_model


def _step_wrapper(fn: Callable[..., Any], spec: dict[str, Any]) -> Callable[..., Any]:
    bridge: list[Any] = []  # the RETURNN bridge, created on first use (needs RETURNN imported)
    globals_ = _globals_of(spec)

    @functools.wraps(fn)
    def step(*, model: Any, extern_data: Any, **kwargs: Any) -> Any:
        kwargs = _accepted(fn, kwargs)
        with returnn_imports() as fallback:
            if fallback:
                return fn(model=model, extern_data=batch_view(extern_data), **kwargs)
            if not bridge:
                from kit.compat.bridge import ReturnnBridge

                bridge.append(ReturnnBridge(spec.get("extern_data"), spec.get("model_outputs")))
            with globals_.active():
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
