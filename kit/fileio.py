"""Atomic file writes: temp file in the same directory → flush + fsync → rename → fsync dir.

A crash at any instant leaves either the old file or the new one, never a torn file.
Files get the mode ``open()`` would give them (0666 minus the umask), not ``mkstemp``'s 0600.
A temp file is named ``<target>.kit-tmp-<pid>-<random>``, so that a later cleanup removes only
temp files of writers that are gone (never another live process's write in progress).
A failed write (e.g. a full disk) names the file it was writing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterator
from typing import IO

TEMP_MARK = ".kit-tmp-"


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temp file beside ``path``; on success it atomically replaces ``path``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _create_temp(path, directory)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None and e.strerror:
            e.filename = path  # ENOSPC from write() names no file; the message then ends with it
        raise
    fsync_dir(directory)


def _create_temp(path: str, directory: str) -> tuple[int, str]:
    """A new temp file beside ``path``, created with mode 0666 so that the umask applies."""
    for _ in range(100):
        tmp = os.path.join(directory, f"{os.path.basename(path)}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp file name", path)


def check_writable(directory: str) -> None:
    """Raise the ``OSError`` that writing a file in ``directory`` would give (a probe file is made and removed)."""
    fd, tmp = _create_temp(os.path.join(directory, ".kit-write-probe"), directory)
    os.close(fd)
    os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def remove_stale_temp_files(directory: str, owns: Callable[[str], bool]) -> list[str]:
    """Delete temp files left by a crash during an earlier write; returns their paths.

    Only temp files whose target name ``owns`` accepts (e.g. the checkpoint names of one model
    prefix), and only those whose writer process is gone: a live writer's file is its write in
    progress.
    """
    removed: list[str] = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        target, mark, tail = name.partition(TEMP_MARK)
        if not mark or not owns(target) or _writer_alive(tail):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _writer_alive(tail: str) -> bool:
    """Whether the process that named a temp file ``...kit-tmp-<tail>`` still runs (unknown: no)."""
    pid_text = tail.split("-", 1)[0]
    if not pid_text.isdigit() or "-" not in tail:
        return False  # not named by this module (or by an old version): its writer is unknown
    return pid_alive(int(pid_text))


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (where that cannot be told: yes, so nothing is deleted).

    Read from ``/proc`` rather than probed with a signal: library code sends no signals.
    """
    if pid <= 0:
        return False
    if not os.path.isdir("/proc/self"):
        return True
    return os.path.exists(f"/proc/{pid}")
