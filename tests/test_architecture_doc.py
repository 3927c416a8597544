"""docs/architecture.md names rooms of kit; every one it names must exist and import.

A module is named in backticks as a path (`kit/engine/step.py`, a package as `kit/engine/`) or
dotted (`kit.engine.step`). Each is imported; a dotted name may also end in an attribute of its
module (`kit.debug.replay`), which must exist. A renamed or removed module fails here until the
page is updated.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^kit(?:/[A-Za-z_][A-Za-z0-9_]*)*(?:/|\.py)?$")
DOTTED = re.compile(r"^kit(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")


def named_modules(text: str) -> list[str]:
    """Every `kit/...` path or `kit.x.y` name in backticks, in order, without repeats."""
    found: list[str] = []
    for span in CODE.findall(text):
        for token in re.split(r"[\s,]+", span.strip()):
            if token.startswith("kit") and (PATH.match(token) or DOTTED.match(token)) and token not in found:
                found.append(token)
    return found


def resolve(name: str) -> object:
    """Import what ``name`` names; raises (ImportError, AttributeError, FileNotFoundError) when it is not there."""
    if "/" in name or name == "kit" or name.endswith(".py"):
        rel = name.rstrip("/")
        path = ROOT / rel
        if name.endswith(".py"):
            if not path.is_file():
                raise FileNotFoundError(f"{name}: no such file")
            module = rel[: -len(".py")].replace("/", ".")
        else:
            if not (path / "__init__.py").is_file():
                raise FileNotFoundError(f"{name}: no such package")
            module = rel.replace("/", ".")
        return importlib.import_module(module)
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


NAMES = named_modules(DOC.read_text(encoding="utf-8"))


def test_the_page_names_the_rooms_the_brief_lists():
    must = ["kit/engine/engine.py", "kit/engine/step.py", "kit/engine/state.py", "kit/engine/progress.py",
            "kit/engine/schedule.py", "kit/engine/compute.py", "kit/engine/guard.py", "kit/engine/build.py",
            "kit/engine/saving.py", "kit/session/facade.py", "kit/session/loop.py", "kit/session/parts.py",
            "kit/session/result.py", "kit/events.py", "kit/data/", "kit/checkpoints/", "kit/widgets/",
            "kit/debug/", "kit/compat/"]
    assert [m for m in must if m not in NAMES] == []
    assert len(NAMES) >= 40


def test_the_page_names_every_package_of_kit():
    """A new room (a package under kit/) needs its line on the page."""
    packages = sorted(f"{p.parent.relative_to(ROOT).as_posix()}/" for p in (ROOT / "kit").glob("*/__init__.py"))
    assert [p for p in packages if p not in NAMES] == []


@pytest.mark.parametrize("name", NAMES)
def test_every_named_module_imports(name):
    assert resolve(name) is not None


def test_the_parser_finds_paths_and_dotted_names_and_nothing_else():
    text = "see `kit/engine/step.py`, `kit/data/` and `kit.engine.state`; not `Engine`, `torch.load` or kit/x.py"
    assert named_modules(text) == ["kit/engine/step.py", "kit/data/", "kit.engine.state"]


@pytest.mark.parametrize("made_up", ["kit/engine/warp_drive.py", "kit/engine/warp_drive/", "kit.engine.warp_drive",
                                     "kit.engine.step.no_such_function"])
def test_a_made_up_name_fails_the_check(made_up):
    """Negative control: a module that does not exist is caught, as a path and as a dotted name."""
    assert named_modules(f"the `{made_up}` room") == [made_up]
    with pytest.raises((ImportError, AttributeError, FileNotFoundError)):
        resolve(made_up)
