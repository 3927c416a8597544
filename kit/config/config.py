"""``Config``: RETURNN-style Python config files or keyword arguments, validated at the boundary.

>>> cfg = Config(batch_size=5000, learning_rate=1e-3)
>>> cfg.int("batch_size")
5000

Every problem (unknown key, wrong type, out of range) is collected and raised as one
:class:`kit.ConfigError` before anything is written or any device is touched.
"""

from __future__ import annotations

import builtins
import difflib
import hashlib
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any, Literal, overload

from kit.config.keys import KEYS, REPLACED_KEYS
from kit.errors import ConfigError

_MISSING = object()

IntKeyWithoutDefault = Literal["newbob_multi_update_interval", "save_every_n_steps", "load_epoch", "epoch", "window"]
FloatKeyWithoutDefault = Literal[
    "newbob_relative_error_grow_threshold", "gradient_clip",
    "gradient_clip_global_norm", "gradient_clip_norm", "gradient_noise",
]


def suggest(name: str, choices: list[str] | None = None, cutoff: float = 0.75) -> str | None:
    """The closest known config key to ``name``, or None."""
    matches = difflib.get_close_matches(
        name, choices if choices is not None else list(KEYS), n=1, cutoff=cutoff
    )
    return matches[0] if matches else None


def _unknown_key_problem(name: str, where: str = "", extra: list[str] | None = None) -> str:
    if name in REPLACED_KEYS:
        return REPLACED_KEYS[name]
    guess = suggest(name, list(KEYS) + list(extra or []))
    hint = f" — did you mean '{guess}'?" if guess else " (see docs/config.md for the known keys)"
    return f"unknown config key '{name}'{where}{hint}"


def _value_problems(items: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, value in items.items():
        key = KEYS.get(name)
        if key is None or key.check is None:
            continue
        expected = key.check(value)
        if expected is not None:
            problems.append(f"config key '{name}': got {value!r}, expected {expected}")
    return problems


def _config_run_error(path: str, code: types.CodeType, exc: Exception) -> tuple[ConfigError, bool]:
    """The error for a config file that raised ``exc`` while it ran (where in the file, and what), and
    whether that message says all (a use of RETURNN that kit's stand-in cannot answer: what to install).
    """
    from kit.compat.imports import returnn_missing

    tb, line = exc.__traceback__, None
    while tb is not None:  # the innermost line of the config file itself
        if tb.tb_frame.f_code.co_filename == code.co_filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    where = f"config file '{path}'" + (f", line {line}" if line is not None else "")
    missing = returnn_missing(exc)
    if missing is not None:
        return ConfigError(f"{where}: {missing}"), True
    return ConfigError(f"{where}: running it raised {type(exc).__name__}: {exc}"), False


class Config(Mapping[str, Any]):
    """Training configuration: known keys are validated, config-file globals are kept."""

    def __init__(self, items: Mapping[str, Any] | None = None, /, **kwargs: Any):
        if isinstance(items, (str, os.PathLike)):
            raise ConfigError(
                f"Config({os.fspath(items)!r}): a file path is not a dict of settings; "
                "use kit.Config.from_file(path, **overrides)"
            )
        self._values: dict[str, Any] = {}
        self._user_globals: dict[str, Any] = {}  # config-file helpers: constants, functions, imports
        self._namespace: dict[str, Any] | None = None  # the config file's globals, shared with its functions
        self.source: str | None = None
        self.version = 0
        self.update(items, **kwargs)

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike, /, **overrides: Any) -> Config:
        """Execute a RETURNN-style Python config file and keep its globals.

        Known keys are validated; other globals (constants, functions, classes, imports)
        are kept for the user's own code; a global that is a near-miss of a known key
        (``learnig_rate``) is an error with the suggestion.
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise ConfigError(f"config file '{path}': cannot read it ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file '{path}': cannot read it (not UTF-8 text: {exc.reason})"
            ) from None
        # '#!rnn.py' (RETURNN's marker) and shebangs are Python comments already; nothing to strip.
        # __file__ as given, as RETURNN sets it: a config deriving paths from it (the run directory) gets
        # RETURNN's paths when started from the same folder with the same relative path
        namespace: dict[str, Any] = {"__file__": path, "__name__": "__kit_config__"}
        code = compile(source, path, "exec")  # a SyntaxError names the file and line itself
        from kit import compat

        try:
            with compat.returnn_imports():  # `import returnn.frontend` works without RETURNN installed
                exec(code, namespace)  # noqa: S102 - the user's own config file, like RETURNN
        except Exception as exc:
            error, own = _config_run_error(path, code, exc)
            raise error from (None if own else exc)
        compat.note_fallback_used(path)
        known, user, problems = {}, {}, []
        for name, value in namespace.items():
            if name.startswith("_") or isinstance(value, types.ModuleType):
                continue
            if name in KEYS or compat.is_returnn_only_key(name):
                known[name] = value
            elif name in REPLACED_KEYS:
                problems.append(f"{REPLACED_KEYS[name]} (in '{path}')")
            elif (guess := suggest(name, cutoff=0.85)) is not None:
                problems.append(f"unknown config key '{name}' in '{path}' — did you mean '{guess}'?")
            else:
                user[name] = value
        known = compat.adapt_config_values(known, known.get, source=path)
        problems += [f"{p} (in '{path}')" for p in _value_problems(known)]
        if problems:
            raise ConfigError(problems)
        config = cls()
        config._values.update(known)
        config._user_globals.update(user)
        config.source = os.path.abspath(path)
        config._namespace = namespace
        config.update(overrides)
        return config

    def update(self, items: Mapping[str, Any] | None = None, /, **kwargs: Any) -> Config:
        """Set keys; unknown keys and bad values are collected into one ConfigError."""
        from kit import compat

        new = dict(items or {})
        new.update(kwargs)
        # RETURNN's own keys and forms (translated, or named in one warning); RETURNN-style functions adapted
        new = compat.adapt_config_values(new, lambda n: self._values.get(n), source=self.source)
        # a config file's own globals can be overridden too (RETURNN's command line allows it)
        user = {k: v for k, v in new.items() if k not in KEYS and k in self._user_globals}
        problems = [_unknown_key_problem(name, extra=list(self._user_globals))
                    for name in new if name not in KEYS and name not in user]
        problems += _value_problems({k: v for k, v in new.items() if k in KEYS})
        if problems:
            raise ConfigError(problems)
        self._values.update({k: v for k, v in new.items() if k not in user})
        self.version += 1  # readers that cache values (the engine's step options) re-read them
        self._user_globals.update(user)
        # functions defined in the config file read its globals: they see overrides, as in RETURNN
        if self._namespace is not None:
            self._namespace.update({k: v for k, v in new.items() if k in self._namespace})
        return self

    def copy(self) -> Config:
        other = type(self)()
        other._values = dict(self._values)
        other._user_globals = dict(self._user_globals)
        other.source = self.source
        return other

    # ---- typed getters ----------------------------------------------------------------

    def typed_value(self, key: str, default: Any = _MISSING) -> Any:
        """The value as set, else ``default``, else the registry default."""
        if key in self._values:
            return self._values[key]
        if key in self._user_globals:
            return self._user_globals[key]
        if default is not _MISSING:
            return default
        if key in KEYS:
            return KEYS[key].default
        raise KeyError(_unknown_key_problem(key))

    value = typed_value

    def get(self, key: str, default: Any = _MISSING) -> Any:  # type: ignore[override]
        """Like :meth:`typed_value`, but a key that is neither set nor known gives ``default`` (None),
        as ``Mapping.get`` promises, instead of raising."""
        if default is _MISSING and not self.has(key) and key not in KEYS:
            return None
        return self.typed_value(key, default)

    # Keys whose registry default is None read as ``X | None``; every other key as ``X``
    # (tests/test_config.py checks these lists against the registry).
    @overload
    def int(self, key: IntKeyWithoutDefault, default: Any = ...) -> int | None: ...  # type: ignore[overload-overlap]
    @overload
    def int(self, key: str, default: Any = ...) -> int: ...

    def int(self, key: str, default: Any = _MISSING) -> int | None:
        v = self.typed_value(key, default)
        if isinstance(v, float) and not v.is_integer():
            raise ConfigError(f"config key '{key}': got {v!r}, expected an int")
        return None if v is None else self._convert(key, v, int)

    @overload
    def float(self, key: FloatKeyWithoutDefault, default: Any = ...) -> float | None: ...  # type: ignore[overload-overlap]
    @overload
    def float(self, key: str, default: Any = ...) -> float: ...

    def float(self, key: str, default: Any = _MISSING) -> float | None:
        v = self.typed_value(key, default)
        return None if v is None else self._convert(key, v, float)

    def bool(self, key: str, default: Any = _MISSING) -> bool:  # every bool key has a default
        v = self.typed_value(key, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
            return v.lower() in ("true", "1", "yes")
        if isinstance(v, int):
            return bool(v)
        raise ConfigError(f"config key '{key}': got {v!r}, expected True or False")

    @staticmethod
    def _convert(key: str, value: Any, type_: type) -> Any:
        if type(value) is type_:  # the common case, read every train step: no conversion, no message
            return value
        expected = "an int" if type_ is int else f"a {type_.__name__}"
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}': got {value!r}, expected {expected}")
        try:
            return type_(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key '{key}': got {value!r}, expected {expected}") from None

    def has(self, key: str) -> builtins.bool:
        """Whether the key was set explicitly (registry defaults do not count)."""
        return key in self._values or key in self._user_globals

    # ---- mapping protocol (explicitly set known keys) ---------------------------------

    def __getitem__(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        if key in self._user_globals:
            return self._user_globals[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> builtins.bool:
        return key in self._values or key in self._user_globals

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> builtins.int:
        return len(self._values)

    @property
    def user_globals(self) -> dict[str, Any]:
        """Globals of the config file that are not config keys (user constants and helpers)."""
        return dict(self._user_globals)

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def digest(self) -> str:
        """A stable hash of the settings (callables by qualified name), for checkpoint manifests."""
        h = hashlib.sha256()
        for name in sorted(self._values):
            h.update(f"{name}={_describe(self._values[name])};".encode())
        return h.hexdigest()[:16]

    def key_digests(self) -> dict[str, str]:
        """A short hash per setting (as in :meth:`digest`), so that a resume can name the keys that changed."""
        return {name: hashlib.sha256(_describe(self._values[name]).encode()).hexdigest()[:12]
                for name in sorted(self._values)}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(self._values.items()))
        src = f" from {self.source}" if self.source else ""
        return f"Config({inner}){src}"


def _describe(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", type(value).__qualname__)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    text = repr(value)
    return text if " at 0x" not in text else type(value).__qualname__
