"""Benchmark results in ``docs/benchmarks.md``: each script replaces its own section there.

A section is the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``: one markdown
table with the date, the machine and the command that made it. A script calls
:func:`write_section` at its end (unless run with ``--no-write``, see :func:`add_write_flag`);
every other section of the file stays as it is, so the page always holds the latest run of
each benchmark and no diary.

>>> table = Table("step", "seconds")
>>> table.add("import kit", "0.061")
>>> write_section("import_time", table.markdown(), "python benchmarks/import_time.py")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
NAME = re.compile(r"^[a-z0-9_.-]+$")


class Table:
    """A markdown table built row by row (cells are strings, written as given)."""

    def __init__(self, *header: str):
        self.header = list(header)
        self.rows: list[list[str]] = []

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.header):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(self.header)} columns")
        self.rows.append([str(c).replace("|", "\\|") for c in cells])

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


def machine() -> str:
    """The machine in one line: CPU, cores, GPU (when CUDA has one), OS, load average, torch and Python versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [f"{cpu} ({platform.machine()}), {os.cpu_count()} cores"]
    torch = sys.modules.get("torch")  # only when the benchmark imported it (import_time must not)
    if torch is not None and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    parts.append(f"{platform.system()} {platform.release()}")
    if hasattr(os, "getloadavg"):  # a shared machine's other work shows in every timing
        parts.append(f"load {os.getloadavg()[0]:.1f}")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this script, as a user would type it (``--no-write`` left out)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    shown = f"benchmarks/{script.name}" if script.parent.name == "benchmarks" else str(argv[0])
    return " ".join(["python", shown, *(shlex.quote(a) for a in argv[1:] if a != "--no-write")])


def section_text(name: str, table: str, command: str, *, notes: str = "", date: datetime.date | None = None,
                 where: str | None = None) -> str:
    """The section as it appears in the file, markers included."""
    day = (date or datetime.datetime.now(datetime.timezone.utc).date()).isoformat()
    body = [f"<!-- bench:{name} -->", f"{day} · {where or machine()} · `{command}`", "", table.strip()]
    if notes.strip():
        body += ["", notes.strip()]
    body.append(f"<!-- /bench:{name} -->")
    return "\n".join(body)


def write_section(name: str, table: str, command: str, *, notes: str = "", path: Path = DOC,
                  date: datetime.date | None = None, where: str | None = None) -> Path:
    """Replace section ``name`` of ``path`` (docs/benchmarks.md) with ``table``; append it when absent.

    Raises ValueError for a name that cannot be a marker, or a file whose markers for ``name`` are
    not one well-formed pair (the file is then left as it was).
    """
    if not NAME.match(name):
        raise ValueError(f"section name {name!r}: use lower-case letters, digits, '_', '.' or '-'")
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    new = section_text(name, table, command, notes=notes, date=date, where=where)
    counts = (text.count(begin), text.count(end))
    if counts == (0, 0):
        text = text.rstrip("\n") + f"\n\n## {name}\n\n{new}\n"
    elif counts == (1, 1) and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        text = head + new + rest.split(end, 1)[1]
    else:
        raise ValueError(f"{path}: the markers of section {name!r} are broken ({counts[0]} begin, {counts[1]} end)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def add_write_flag(parser: argparse.ArgumentParser) -> None:
    """``--no-write``: print only, leave docs/benchmarks.md as it is."""
    parser.add_argument("--no-write", action="store_true",
                        help="print the results only; do not update docs/benchmarks.md")


def publish(args: argparse.Namespace, name: str, table: Table | str, *, notes: str = "") -> None:
    """A script's tail: write its table into docs/benchmarks.md unless ``--no-write`` was given."""
    if getattr(args, "no_write", False):
        return
    text = table.markdown() if isinstance(table, Table) else table
    path = write_section(name, text, command_line(), notes=notes, path=DOC)
    print(f"\nwrote section {name!r} of {path}")
