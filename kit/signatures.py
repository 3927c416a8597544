"""Which keyword arguments a callable takes: kit calls user code and event handlers by keyword."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def keyword_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The names ``fn`` takes by keyword; None when it takes ``**kwargs`` (any keyword) or has no
    signature to read (a builtin), so that callers pass everything."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                           inspect.Parameter.KEYWORD_ONLY))
