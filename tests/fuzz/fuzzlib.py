"""Mutations of a file's bytes and the one check every fuzzer makes of the outcome."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from kit.errors import KitError

# byte strings that break readers in known ways: huge and negative numbers, deep nesting, quotes, NULs
SPECIAL = [b"1e999", b"-1", b"-0.01", b"9" * 400, b"9" * 5000, b"nan", b"NaN", b"inf", b"[" * 2000, b"{" * 500,
           b"\x00", b"'", b'"', b"\\", b"\xff\xfe", b"None", b"__import__('os')", b"EpochData(", b"\n", b",",
           b"2**40", b"1099511627776", b"0x7fffffff", b"\x80\x02", b"PK\x03\x04"]

MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 2**31)),
    st.tuples(st.just("overwrite"), st.integers(0, 2**31), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("insert"), st.integers(0, 2**31), st.sampled_from(SPECIAL)),
    st.tuples(st.just("replace"), st.integers(0, 2**31), st.sampled_from(SPECIAL)),
)
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=3)


def mutate(data: bytes, mutations: list[tuple]) -> bytes:
    """``data`` with each mutation applied in turn (positions taken modulo the current length)."""
    buf = bytearray(data)
    for kind, pos, *arg in mutations:
        at = pos % (len(buf) + 1)
        if kind == "flip" and buf:
            buf[at % len(buf)] ^= 1 << arg[0]
        elif kind == "truncate":
            del buf[at:]
        elif kind == "overwrite":
            buf[at:at + len(arg[0])] = arg[0]
        elif kind == "insert":
            buf[at:at] = arg[0]
        elif kind == "replace":  # a token-sized run replaced, e.g. a digit run by a huge number
            end = at
            while end < len(buf) and end - at < 8 and chr(buf[end]).isalnum():
                end += 1
            buf[at:max(end, at + 1)] = arg[0]
    return bytes(buf)


class Hang(AssertionError):
    pass


def outcome(read: Callable[[], Any], path: str | os.PathLike, *, timeout: float = 20.0) -> tuple[str, Any]:
    """Run ``read()``: ("error", the kit error) when it names the file, ("value", the result) when it returns.

    Fails the test for anything else: a raw (non-kit) exception, a kit error that does not name the
    file, or a read that does not end within ``timeout`` seconds.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = read()
        except BaseException as e:  # noqa: BLE001 - classified below
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise Hang(f"reading {path} did not end within {timeout} s")
    error = result.get("error")
    if error is None:
        return "value", result["value"]
    name = os.fspath(path)
    if isinstance(error, KitError) and (name in str(error) or os.path.basename(name) in str(error)):
        return "error", error
    raise AssertionError(f"reading {name} gave {type(error).__name__}: {str(error)[:500]}") from error


def canonical(value: Any) -> Any:
    """A comparable form: NaN equal to NaN, dict order ignored, tuples as lists, ints and floats apart."""
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else repr(value))
    if isinstance(value, dict):
        return ("dict", sorted((repr(canonical(k)), canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("list", [canonical(v) for v in value])
    return (type(value).__name__, value)
