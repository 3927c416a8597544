"""``python -m kit._config_docs``: the older name of ``python -m kit.config.docs`` (kept for scripts)."""

from kit.config.docs import DEFAULT_PATH, expected_text, main

__all__ = ["DEFAULT_PATH", "expected_text", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
