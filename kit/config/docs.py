"""Write (or check) ``docs/config.md`` from the config key registry.

python -m kit.config.docs            # rewrite docs/config.md (and docs/returnn_keys.md)
python -m kit.config.docs --check    # exit 1 when docs/config.md is stale

With RETURNN installed, the keys its torch path reads (found in its source) must all be in
kit/compat/returnn_keys.py's table or kit's registry, else nothing is written and the exit code is 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kit.config.keys import config_reference_markdown

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
RETURNN_KEYS_PATH = DEFAULT_PATH.parent / "returnn_keys.md"


def expected_text() -> str:
    text = config_reference_markdown()
    return text if text.endswith("\n") else text + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kit.config.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs, write nothing")
    parser.add_argument(
        "--path", type=Path, default=DEFAULT_PATH, help="default: docs/config.md of this checkout"
    )
    args = parser.parse_args(argv)
    if args.path == DEFAULT_PATH:  # the checkout's docs: RETURNN's key table too
        from kit.compat.returnn_keys import returnn_keys_markdown

        if _missing_returnn_keys():
            return 1
        if _write_or_check(RETURNN_KEYS_PATH, returnn_keys_markdown(), check=args.check):
            return 1
    want = expected_text()
    try:
        have = args.path.read_text(encoding="utf-8")
    except FileNotFoundError:
        have = None
    if args.check:
        if have != want:
            print(f"{args.path} is stale: run `python -m kit.config.docs`", file=sys.stderr)
            return 1
        print(f"{args.path} is up to date")
        return 0
    if have != want:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(want, encoding="utf-8")
        print(f"wrote {args.path}")
    else:
        print(f"{args.path} is up to date")
    return 0


def _missing_returnn_keys() -> bool:
    """With RETURNN installed: name the keys its torch path reads that kit's RETURNN table lacks (True if any).

    Without RETURNN nothing is checked (the table is written as it stands)."""
    import importlib.util

    spec = importlib.util.find_spec("returnn")
    if spec is None or not spec.submodule_search_locations:
        print("RETURNN is not installed: its config reads were not checked against the table", file=sys.stderr)
        return False
    from kit.compat.returnn_keys import missing_returnn_keys

    package = list(spec.submodule_search_locations)[0]
    missing = missing_returnn_keys(package)
    if missing:
        print(f"RETURNN ({package}) reads config keys that kit/compat/returnn_keys.py does not list: "
              f"{', '.join(missing)}; add each (a kit key, translated, no effect or unsupported)", file=sys.stderr)
    return bool(missing)


def _write_or_check(path: Path, want: str, *, check: bool) -> bool:
    """Write ``want`` to ``path`` (or only compare, with ``check``); True when stale in check mode."""
    have = path.read_text(encoding="utf-8") if path.exists() else None
    if check:
        if have != want:
            print(f"{path} is stale: run `python -m kit.config.docs`", file=sys.stderr)
            return True
        return False
    if have != want:
        path.write_text(want, encoding="utf-8")
        print(f"wrote {path}")
    return False


if __name__ == "__main__":
    raise SystemExit(main())
