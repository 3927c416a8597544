"""benchmarks/report.py: a benchmark replaces its own section of docs/benchmarks.md and nothing else."""

from __future__ import annotations

import datetime
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import report  # noqa: E402

DAY = datetime.date(2027, 1, 2)
PAGE = """# Benchmarks

intro

<!-- bench:a -->
old a
<!-- /bench:a -->

between

<!-- bench:b -->
old b
<!-- /bench:b -->
"""


def test_write_section_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(PAGE, encoding="utf-8")
    table = report.Table("x", "y")
    table.add("1", "2")
    report.write_section("a", table.markdown(), "python benchmarks/a.py", path=path, date=DAY, where="box")
    text = path.read_text(encoding="utf-8")
    assert "old a" not in text and "old b" in text and "intro" in text and "between" in text
    assert "<!-- bench:a -->\n2027-01-02 · box · `python benchmarks/a.py`\n\n| x | y |\n|---|---|\n| 1 | 2 |\n" \
           "<!-- /bench:a -->" in text
    again = report.write_section("a", "| z |\n|---|", "cmd", path=path, date=DAY, where="box").read_text("utf-8")
    assert again.count("<!-- bench:a -->") == 1 and "| 1 | 2 |" not in again  # replaced, not appended


def test_a_new_section_is_appended_under_its_own_heading(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(PAGE, encoding="utf-8")
    report.write_section("c.mlp", "| t |\n|---|", "cmd", path=path, date=DAY, where="box")
    text = path.read_text(encoding="utf-8")
    assert text.startswith(PAGE.rstrip("\n")) and text.endswith("## c.mlp\n\n<!-- bench:c.mlp -->\n"
                                                               "2027-01-02 · box · `cmd`\n\n| t |\n|---|\n"
                                                               "<!-- /bench:c.mlp -->\n")


@pytest.mark.parametrize("broken", [PAGE.replace("<!-- /bench:a -->", ""), PAGE + "<!-- bench:a -->\n"])
def test_broken_markers_are_an_error_and_leave_the_file_alone(tmp_path, broken):
    path = tmp_path / "benchmarks.md"
    path.write_text(broken, encoding="utf-8")
    with pytest.raises(ValueError, match="markers of section 'a'"):
        report.write_section("a", "| t |", "cmd", path=path, date=DAY, where="box")
    assert path.read_text(encoding="utf-8") == broken


def test_no_write_leaves_the_page_alone_and_the_command_omits_the_flag(tmp_path, monkeypatch):
    path = tmp_path / "benchmarks.md"
    path.write_text(PAGE, encoding="utf-8")
    monkeypatch.setattr(report, "DOC", path)
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/a.py", "--rounds", "3", "--no-write"])
    parser = report.argparse.ArgumentParser()
    report.add_write_flag(parser)
    parser.add_argument("--rounds")
    report.publish(parser.parse_args(["--no-write"]), "a", "| t |")
    assert path.read_text(encoding="utf-8") == PAGE
    assert report.command_line() == "python benchmarks/a.py --rounds 3"


def test_the_page_has_one_well_formed_section_per_benchmark():
    text = report.DOC.read_text(encoding="utf-8")
    names = report.re.findall(r"<!-- bench:([^ ]+) -->", text)
    assert len(names) == len(set(names)) and {"import_time", "step_lines", "checkpoint"} <= set(names)
    for name in names:
        assert text.count(f"<!-- /bench:{name} -->") == 1, name
