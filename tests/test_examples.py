"""``kit.examples``: the example configs ship inside the package and are found from any folder."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

import kit
import kit.examples

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def test_path_names_a_config_that_loads_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as a notebook copied alone into an empty folder
    path = kit.examples.path("12ax")
    assert Path(path).is_absolute() and Path(path).is_file()
    assert kit.examples.path("12ax.py") == path
    config = kit.Config.from_file(path)
    assert config.typed_value("get_model") is not None and config.typed_value("train_step") is not None
    assert "def train_step" in kit.examples.source("12ax")


def test_unknown_name_is_a_config_error_that_lists_the_known_ones():
    assert kit.examples.names() == ["12ax"]
    with pytest.raises(kit.ConfigError, match=r"no example config '12x'.*did you mean '12ax'.*known: 12ax"):
        kit.examples.path("12x")


def test_every_example_config_is_package_data():
    """A wheel holds kit/examples/*.py only when pyproject's package-data names them (not modules)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["kit"]
    for name in kit.examples.names():
        relative = Path(kit.examples.path(name)).relative_to(ROOT / "kit").as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), (relative, patterns)


def test_the_clone_s_examples_folder_is_the_same_config():
    """``python -m kit train examples/12ax.py`` (README) runs the file that ships in the package."""
    assert (ROOT / "examples" / "12ax.py").read_bytes() == Path(kit.examples.path("12ax")).read_bytes()


def test_kit_examples_is_reachable_as_an_attribute_after_import_kit():
    # as the notebooks and the README write it: `import kit` then `kit.examples.path(...)`
    import subprocess
    import sys

    code = "import kit; print(kit.examples.path('12ax'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("12ax.py")
