"""One training run per model prefix: a lock held for the run's lifetime, removed at its end.

The lock is ``fcntl.flock`` on ``<prefix>.lock`` beside the checkpoints (holding the holder's pid
and host) and, on Linux, a unix socket bound to a name in the abstract namespace derived from the
prefix's folder (device and inode) and base name. The kernel drops both when the holder dies
(even by ``kill -9``), so a dead run's lock is taken over without any cleanup. The socket name
lives in no folder, so deleting or replacing ``<prefix>.lock`` while a run holds it does not let a
second run in. A second process asking for the lock gets a :class:`PrefixLockedError` naming the
prefix and the holder's pid.

After taking the flock, the holder checks that the path still names the file it locked (same
inode); a file removed by an exiting holder in between is opened anew. At release the holder
removes the lock file (while still holding it) and any folder it created for the prefix that
stayed empty: a run that stops on a config error leaves nothing behind.

Inside one process (a notebook re-running the cell that builds a Session) the newest claimant
takes the lock over; the older holder is then told so when it tries to save.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import threading
import weakref
from typing import ClassVar

from kit import fileio
from kit.errors import ConfigError, PrefixLockedError

__all__ = ["LOCK_SUFFIX", "PrefixLock", "PrefixLockedError"]

logger = logging.getLogger("kit")

LOCK_SUFFIX = ".lock"


class PrefixLock:
    """The lock on one model prefix; :meth:`acquire` it, :meth:`release` it (or let it be collected)."""

    # realpath of the lock file -> the PrefixLock holding it in this process (a flock belongs to
    # an open file, so a second open in this process would conflict with the first)
    _held: ClassVar[dict[str, weakref.ref[PrefixLock]]] = {}
    _guard: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, prefix: str, path: str, fd: int | None, name: socket.socket | None = None,
                 created: tuple[str, ...] = ()):
        self.prefix = prefix
        self.path = path
        self._fd = fd
        self._name = name
        self._created = created  # folders made for the prefix, removed at release when empty
        self._finalizer = weakref.finalize(self, _close, fd, name) if fd is not None else None

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock (False after release or an in-process takeover)."""
        return self._fd is not None

    @classmethod
    def acquire(cls, prefix: str) -> PrefixLock:
        """Lock ``prefix`` for this run; checks that checkpoints can be written there.

        Raises:
            ConfigError: the ``model`` path cannot hold files (names ``model``, the path and why).
            PrefixLockedError: another live process holds the lock (names its pid).
        """
        path = os.fspath(prefix) + LOCK_SUFFIX
        created = _check_writable(prefix)
        try:
            import fcntl  # noqa: F401
        except ImportError:  # Windows: no flock; runs are not protected from each other
            return cls(prefix, path, None)
        key = os.path.realpath(path)
        with cls._guard:
            previous = cls._held.get(key)
            holder = previous() if previous is not None else None
            if holder is not None and holder.held:
                return cls._take_over(holder, key)
            try:
                name = _claim_name(prefix, path)
                fd = _lock_file(prefix, path, name)
            except BaseException:
                _remove_empty(created)
                raise
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            lock = cls(prefix, path, fd, name, created)
            cls._held[key] = weakref.ref(lock)
            return lock

    @classmethod
    def _take_over(cls, holder: PrefixLock, key: str) -> PrefixLock:
        logger.warning(
            "model prefix %r was in use by another Session/Engine in this process; the new one takes it over "
            "(the old one can no longer save checkpoints)", holder.prefix)
        name, created = holder._name, holder._created
        lock = cls(holder.prefix, holder.path, holder.hand_over(), name, created)
        cls._held[key] = weakref.ref(lock)
        return lock

    def hand_over(self) -> int | None:
        """Give this object's open lock file to a new holder in this process; this one no longer holds it."""
        fd, self._fd, self._name = self._fd, None, None
        if self._finalizer is not None:
            self._finalizer.detach()
        return fd

    def check(self) -> None:
        """Raise :class:`PrefixLockedError` unless this object still holds the lock (call before a save)."""
        if not self.held:
            raise PrefixLockedError(
                f"model prefix {self.prefix!r}: this run no longer holds the lock (another Session in this "
                f"process took it over, or the run was closed); not saving, so as not to mix two runs' files"
            )

    def release(self) -> None:
        """Give the lock up: the lock file is removed (and the folders made for it, when still empty)."""
        fd, name, self._fd, self._name = self._fd, self._name, None, None
        if fd is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        with self._guard:
            key = os.path.realpath(self.path)
            if (ref := self._held.get(key)) is not None and ref() is self:
                del self._held[key]
        try:
            if _same_file(fd, self.path):  # while still locked: never another holder's new file
                os.unlink(self.path)
        except OSError:
            pass
        _close(fd, name)
        _remove_empty(self._created)

    def __repr__(self) -> str:
        return f"PrefixLock({self.prefix!r}, {'held' if self.held else 'released'})"


def _close(fd: int | None, name: socket.socket | None = None) -> None:
    if fd is not None:
        try:
            os.close(fd)  # closing the last descriptor releases the flock
        except OSError:
            pass
    if name is not None:
        name.close()


def _locked_error(prefix: str, path: str, who: str) -> PrefixLockedError:
    return PrefixLockedError(
        f"model prefix {prefix!r} is in use by another run ({who}; lock file {path}): two runs writing the same "
        f"checkpoints would destroy each other's. Wait for it to end, stop it, or use another 'model' path")


def _claim_name(prefix: str, path: str) -> socket.socket | None:
    """Bind a unix socket to the prefix's name in Linux's abstract namespace (no file: it cannot be deleted).

    The name is built from the folder's device and inode and the prefix's base name, so that every
    path that reaches the same folder (symlinks, relative paths) gives the same name.
    """
    if not sys.platform.startswith("linux"):
        return None
    folder = os.stat(os.path.dirname(os.path.abspath(prefix)))
    digest = hashlib.sha256(f"{folder.st_dev}:{folder.st_ino}:{os.path.basename(prefix)}".encode()).hexdigest()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0kit-prefix-lock-" + digest[:40])
    except OSError:
        sock.close()
        raise _locked_error(prefix, path, _read_holder_file(path)) from None
    return sock


def _lock_file(prefix: str, path: str, name: socket.socket | None) -> int:
    """Open and flock ``path``; retried when the file was removed or replaced between open and lock."""
    import fcntl

    for _ in range(100):
        fd = _open_lock_file(prefix, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _read_holder(fd)
            _close(fd, name)
            raise _locked_error(prefix, path, who) from None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the holder that just ended removed it: lock the new file
    _close(None, name)
    raise PrefixLockedError(f"model prefix {prefix!r}: its lock file {path} keeps being replaced by another process")


def _same_file(fd: int, path: str) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _remove_empty(folders: tuple[str, ...]) -> None:
    for folder in folders:  # deepest first
        try:
            os.rmdir(folder)
        except OSError:
            return


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _check_writable(prefix: str) -> tuple[str, ...]:
    """One ConfigError naming ``model`` when its folder cannot hold checkpoint files; returns the
    folders it created, deepest first."""
    directory = os.path.dirname(os.path.abspath(prefix))
    if os.path.isdir(prefix):
        raise ConfigError(f"config key 'model': {prefix!r} is a folder; 'model' is a path prefix of the checkpoint "
                          f"files, e.g. {os.path.join(prefix, 'model')!r}")
    missing = []
    folder = directory
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(directory, exist_ok=True)
        fileio.check_writable(directory)
    except OSError as e:
        _remove_empty(tuple(missing))
        raise ConfigError(f"config key 'model': cannot write checkpoints under {prefix!r} "
                          f"(folder {directory!r}: {_why(e)})") from None
    return tuple(missing)


def _open_lock_file(prefix: str, path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ConfigError(f"config key 'model': cannot create the lock file {path!r} for {prefix!r} ({_why(e)})") from None


def _read_holder_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return f"pid unknown: its lock file {path} was removed while it runs"
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown (it is just starting)"
