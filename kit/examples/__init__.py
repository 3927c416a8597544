"""Example configs that ship inside kit, so that a notebook or script finds them from any folder.

>>> import kit.examples
>>> kit.examples.names()
['12ax']
>>> session = kit.Session.from_config(kit.examples.path("12ax"), num_epochs=2)  # doctest: +SKIP

From a terminal: ``python -m kit train "$(python -c 'import kit.examples; print(kit.examples.path("12ax"))')"``
(in a clone, ``examples/12ax.py`` is the same file).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from kit.errors import ConfigError

FOLDER = Path(__file__).resolve().parent


def names() -> list[str]:
    """The names of the shipped example configs (``path(name)`` gives each one's file)."""
    return sorted(p.stem for p in FOLDER.glob("*.py") if not p.name.startswith("_"))


def path(name: str) -> str:
    """The file of the example config ``name`` (e.g. ``"12ax"``), for ``Session.from_config`` or the CLI.

    Raises:
        ConfigError: no example of that name (the message lists the known ones).
    """
    stem = name[:-3] if name.endswith(".py") else name
    known = names()
    if stem not in known:
        guess = difflib.get_close_matches(stem, known, n=1)
        hint = f" — did you mean '{guess[0]}'?" if guess else ""
        raise ConfigError(f"kit.examples.path: no example config {name!r}{hint} (known: {', '.join(known)})")
    return str(FOLDER / f"{stem}.py")


def source(name: str) -> str:
    """The text of the example config ``name`` (to read it, or to write a changed copy of it)."""
    return Path(path(name)).read_text(encoding="utf-8")
