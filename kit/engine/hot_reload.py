"""RETURNN's ``use_hot_reloading``: change the code while training runs, from the terminal.

Only when stdin is a terminal and ``use_hot_reloading = True`` (or ``RETURNN_USE_HOT_RELOADING=1``), as
RETURNN. Each train step then asks, after it ran, what to do: ``r`` reload the changed modules, ``t`` try
the step again, ``c`` continue; when the step raised: ``r``, ``t``, ``d`` debug (pdb), ``e`` re-raise, ``q``
quit. Reloading re-imports every changed module the config's functions and classes come from (and the
config file itself when it changed: its functions and classes replace the config's), and the config's
values are updated to the new objects; the step retried runs the new code on the same batch and state.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("kit")

Ask = Callable[[str], str]


def should_use(config: Any) -> bool:
    """RETURNN's rule: a terminal on stdin, and the key (or ``RETURNN_USE_HOT_RELOADING=1``)."""
    if not sys.stdin or not sys.stdin.isatty():
        return False
    return config.bool("use_hot_reloading") or os.environ.get("RETURNN_USE_HOT_RELOADING", "0") == "1"


def _user_module(name: str | None) -> types.ModuleType | None:
    """A module of the user's own (a .py file outside the interpreter's prefixes), else None."""
    mod = sys.modules.get(name or "")
    path = getattr(mod, "__file__", None)
    if mod is None or getattr(mod, "__spec__", None) is None or not path or not path.endswith(".py"):
        return None
    if name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()):
        return None
    if any(path.startswith(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}):
        return None
    return mod


def _modules_of(value: Any, found: dict[str, None], depth: int = 0) -> None:
    """The user modules ``value`` (a function, class, container or partial) comes from, into ``found``."""
    if depth > 4 or value is None or isinstance(value, (int, float, str, bool, types.ModuleType)):
        return
    if isinstance(value, (list, tuple, set)):
        for item in value:
            _modules_of(item, found, depth + 1)
    elif isinstance(value, Mapping):
        for item in value.values():
            _modules_of(item, found, depth + 1)
    elif isinstance(value, functools.partial):
        _modules_of([value.func, *value.args, *value.keywords.values()], found, depth + 1)
    elif isinstance(value, (types.FunctionType, type)):
        if _user_module(value.__module__) is not None:
            found.setdefault(value.__module__, None)
        if isinstance(value, types.FunctionType):  # what the function's body names (helpers, classes)
            _modules_of([value.__globals__.get(n) for n in value.__code__.co_names], found, depth + 1)


def _renewed(value: Any, reloaded: set[str]) -> Any:
    """``value`` with functions and classes of ``reloaded`` modules replaced by their new objects."""
    if isinstance(value, list):
        return [_renewed(v, reloaded) for v in value]
    if isinstance(value, tuple):
        return tuple(_renewed(v, reloaded) for v in value)
    if isinstance(value, dict):
        return {k: _renewed(v, reloaded) for k, v in value.items()}
    if isinstance(value, functools.partial):
        return functools.partial(_renewed(value.func, reloaded), *_renewed(list(value.args), reloaded),
                                 **_renewed(dict(value.keywords), reloaded))
    if isinstance(value, (types.FunctionType, type)) and value.__module__ in reloaded:
        return getattr(sys.modules[value.__module__], value.__name__, value)
    return value


class ConfigReloader:
    """Watches the modules of a config's values (and its file); :meth:`reload` brings the changes in."""

    def __init__(self, config: Any, ask: Ask | None = None):
        self.config, self._ask = config, ask
        found: dict[str, None] = {}
        for name in config:
            _modules_of(config.typed_value(name), found)
        self.modules = list(found)
        self._mtimes = {m: os.path.getmtime(sys.modules[m].__file__ or "") for m in self.modules}
        self._config_mtime = os.path.getmtime(config.source) if config.source else None
        logger.info("hot reloading: watching %s", ", ".join(self.modules + ([config.source] if config.source else []))
                    or "nothing (the config's functions come from no module of yours)")

    def changed(self) -> list[str]:
        out = [m for m in self.modules if os.path.getmtime(sys.modules[m].__file__ or "") != self._mtimes[m]]
        if self.config.source and os.path.getmtime(self.config.source) != self._config_mtime:
            out.append(self.config.source)
        return out

    def reload(self) -> list[str]:
        """Re-import the changed modules (re-run a changed config file); the config points to the new objects."""
        changed = self.changed()
        modules = {m for m in changed if m in self._mtimes}
        for name in modules:
            logger.info("hot reloading: module %r changed, reloading", name)
            importlib.reload(sys.modules[name])
            self._mtimes[name] = os.path.getmtime(sys.modules[name].__file__ or "")
        updates = {}
        for key in self.config:
            value = self.config.typed_value(key)
            new = _renewed(value, modules)
            if new is not value and new != value:
                updates[key] = new
        if self.config.source in changed:
            updates.update(self._from_config_file())
        if updates:
            logger.info("hot reloading: config keys %s updated", ", ".join(sorted(updates)))
            self.config.update(updates)
        return changed

    def _from_config_file(self) -> dict[str, Any]:
        from kit.config import Config

        source = self.config.source
        self._config_mtime = os.path.getmtime(source)
        fresh = Config.from_file(source)
        return {k: fresh.typed_value(k) for k in fresh
                if isinstance(fresh.typed_value(k), (types.FunctionType, type, functools.partial))}

    def interact(self, actions: dict[str, str], error: BaseException | None = None) -> str:
        """Ask until the answer is one of ``actions`` (after reloads, a debugger, ...); returns it."""
        choices = {"r": "reload modules", **actions}
        if error is not None:
            choices.update({"d": "debug", "e": "reraise"})
        choices["q"] = "quit"
        while True:
            answer = (self._ask or input)("Hot reloading: " + ", ".join(f"'{k}' to {v}" for k, v in choices.items()) + ": ").strip()
            if answer == "r":
                if not self.reload():
                    print("No changes detected? Change the source code of:", ", ".join(self.modules) or "(none)")
            elif answer in actions:
                return answer
            elif answer == "d" and error is not None:
                import pdb

                pdb.post_mortem(error.__traceback__)
            elif answer == "e" and error is not None:
                raise error
            elif answer == "q":
                raise KeyboardInterrupt("quit from hot reloading")
            else:
                print(f"Invalid choice {answer!r}")


def hot_step(config: Any, key: str, reloader: ConfigReloader) -> Callable[..., Any]:
    """The config's ``key`` step function, asking after each call (and on each error) as RETURNN does; a retry
    clears what the try marked and calls the config's current function."""

    def step(**kwargs: Any) -> Any:
        from kit.run_ctx import current_run_ctx

        while True:
            ctx = current_run_ctx()
            if ctx is not None:
                ctx.losses.clear()
                ctx.outputs.clear()
            try:
                result = config.typed_value(key)(**kwargs)
            except (Exception, KeyboardInterrupt) as exc:
                print(f"Exception in {key} with hot reloading enabled:", file=sys.stderr)
                traceback.print_exception(type(exc), exc, exc.__traceback__)
                reloader.interact({"t": "try again"}, exc)
                continue
            if reloader.interact({"t": "try again", "c": "continue"}) == "c":
                return result

    step.__name__ = step.__qualname__ = key
    return step
