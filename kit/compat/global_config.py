"""RETURNN's global config and behaviour version, as RETURNN-style user code expects to find them.

RETURNN's frontend reads some switches from RETURNN's global config (``rf_dropout_broadcast``,
``rf_att_dropout_broadcast``, ``rf_native_opt``, ... — keys kit itself has no use for) and others from
``behavior_version``. RETURNN sets both when it loads a config. kit does the same for a config whose
user functions use RETURNN, with RETURNN installed:

- the global config is a ``returnn.config.Config`` holding the config's values, made global only
  around kit's calls into that config's user code (``global_config_ctx``), so that two sessions in one
  kernel each see their own;
- the behaviour version is process-wide in RETURNN and can be set once: kit sets it at the first call
  into the user code, and a second config asking for another version is a ``ConfigError`` (as RETURNN
  would refuse it) rather than code silently running under the wrong one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from kit.errors import ConfigError


class ReturnnGlobals:
    """The config values RETURNN's global config holds for one config's user code (made on first use)."""

    def __init__(self, values: Mapping[str, Any]):
        self.values = dict(values)
        self._config: Any = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """RETURNN's global config is this config's while the block runs (needs RETURNN imported)."""
        from returnn.config import global_config_ctx  # type: ignore[import-untyped]

        if self._config is None:
            self._config = self._make()
        with global_config_ctx(self._config):
            yield

    def _make(self) -> Any:
        from returnn.config import Config  # type: ignore[import-untyped]

        set_behavior_version(self.values.get("behavior_version"))
        config = Config()
        config.update(self.values)
        return config


def set_behavior_version(version: Any) -> None:
    """RETURNN's ``BehaviorVersion.set`` for the config's ``behavior_version`` (once per process, as RETURNN)."""
    if version is None:
        return
    from returnn.util.basic import BehaviorVersion  # type: ignore[import-untyped]

    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(f"config key 'behavior_version': expected an int, got {version!r}")
    current = BehaviorVersion.get_if_set()
    if current is not None and current != version:
        raise ConfigError(
            f"config key 'behavior_version': {version}, but RETURNN's behaviour version in this process is already "
            f"{current} (RETURNN sets it once per process): use {current}, or run this config in a new kernel/process"
        )
    BehaviorVersion.set(version)
