"""``docs/config.md`` is generated from the key registry and must not go stale."""

from __future__ import annotations

from pathlib import Path

from kit.config import docs as config_docs
from kit.config.keys import KEYS, config_reference_markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "config.md"


def test_docs_config_md_is_up_to_date():
    assert DOCS.is_file(), "docs/config.md is missing: run `python -m kit.config.docs`"
    have = DOCS.read_text(encoding="utf-8")
    assert have.rstrip("\n") == config_reference_markdown().rstrip("\n"), (
        "docs/config.md is stale: run `python -m kit.config.docs` and commit the result"
    )


def test_every_key_is_documented():
    text = config_reference_markdown()
    for name in KEYS:
        assert f"| `{name}` |" in text, name


def test_check_mode_exit_codes(tmp_path, capsys):
    path = tmp_path / "config.md"
    assert config_docs.main(["--check", "--path", str(path)]) == 1  # missing
    path.write_text("# old\n", encoding="utf-8")
    assert config_docs.main(["--check", "--path", str(path)]) == 1  # stale
    assert path.read_text(encoding="utf-8") == "# old\n"  # --check writes nothing
    assert config_docs.main(["--path", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == config_docs.expected_text()
    assert config_docs.main(["--check", "--path", str(path)]) == 0
    assert "stale" in capsys.readouterr().err
