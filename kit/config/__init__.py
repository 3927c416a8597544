"""Configuration: ``Config`` (values and typed getters), the key registry (:mod:`kit.config.keys`:
one source for validation, defaults, "did you mean" and ``docs/config.md``) and the docs
generator (``python -m kit.config.docs``)."""

from kit.config.config import Config, suggest
from kit.config.keys import KEYS, REPLACED_KEYS, Key

__all__ = ["KEYS", "REPLACED_KEYS", "Config", "Key", "suggest"]
