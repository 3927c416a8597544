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
import stat
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


# ---- reading files kit did not write -------------------------------------------------------------


def file_kind(mode: int) -> str:
    """A word for a file's type: 'FIFO', 'folder', 'character device', ..."""
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "folder"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def check_regular_file(path: str, what: str, error: type[Exception] | None = None) -> os.stat_result:
    """``os.stat`` of ``path`` when it is a regular file; else ``error`` (default DataError) naming it.

    Checked before opening: a FIFO opened for reading waits for a writer forever, a device may never end.
    """
    from kit.errors import DataError

    error = error or DataError
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: file {path} does not exist") from None
    except OSError as e:
        raise error(f"{what}: cannot read {path} ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what}: {path} is a {file_kind(info.st_mode)}, not a regular file")
    return info


def read_capped(path: str, limit: int, what: str, error: type[Exception], why: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; ``error`` naming the file otherwise.

    ``why``: what makes ``limit`` enough (said in the message, so that a user knows whether the file or
    the limit is wrong). Never blocks on a FIFO (opened non-blocking, and refused after ``fstat``).
    """
    check_regular_file(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise error(f"{what}: cannot open {path} ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # replaced between stat and open
            raise error(f"{what}: {path} is a {file_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise error(f"{what}: {path} is {info.st_size} bytes, more than kit reads ({limit}: {why})")
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise error(f"{what}: {path} grew beyond {limit} bytes while read ({why})")
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{what}: cannot read {path} ({e.strerror or e})") from None
    finally:
        os.close(fd)
