"""One training run per model prefix: an advisory lock on ``<prefix>.lock`` for the run's lifetime.

The lock is ``fcntl.flock`` on a small file beside the checkpoints; it holds the holder's pid
and host. The kernel drops it when the holder dies (even by ``kill -9``), so a dead run's lock
is taken over without any cleanup. A second process asking for it gets a :class:`PrefixLockedError`
naming the prefix and the holder's pid.

Inside one process (a notebook re-running the cell that builds a Session) the newest claimant
takes the lock over; the older holder is then told so when it tries to save. The file stays
after the run (removing it would race with a run that is just opening it); it is kit's own file
and never a problem in a RETURNN run directory, which has no such name.
"""

from __future__ import annotations

import logging
import os
import socket
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

    def __init__(self, prefix: str, path: str, fd: int | None):
        self.prefix = prefix
        self.path = path
        self._fd = fd
        self._finalizer = weakref.finalize(self, _close, fd) if fd is not None else None

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
        _check_writable(prefix)
        try:
            import fcntl
        except ImportError:  # Windows: no flock; runs are not protected from each other
            return cls(prefix, path, None)
        key = os.path.realpath(path)
        with cls._guard:
            previous = cls._held.get(key)
            holder = previous() if previous is not None else None
            if holder is not None and holder.held:
                return cls._take_over(holder, key)
            fd = _open_lock_file(prefix, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _read_holder(fd)
                os.close(fd)
                raise PrefixLockedError(
                    f"model prefix {prefix!r} is in use by another run ({who}; lock file {path}): two runs writing "
                    f"the same checkpoints would destroy each other's. Wait for it to end, stop it, or use another "
                    f"'model' path"
                ) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            lock = cls(prefix, path, fd)
            cls._held[key] = weakref.ref(lock)
            return lock

    @classmethod
    def _take_over(cls, holder: PrefixLock, key: str) -> PrefixLock:
        logger.warning(
            "model prefix %r was in use by another Session/Engine in this process; the new one takes it over "
            "(the old one can no longer save checkpoints)", holder.prefix)
        lock = cls(holder.prefix, holder.path, holder.hand_over())
        cls._held[key] = weakref.ref(lock)
        return lock

    def hand_over(self) -> int | None:
        """Give this object's open lock file to a new holder in this process; this one no longer holds it."""
        fd, self._fd = self._fd, None
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
        """Give the lock up (the file stays, emptied)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        with self._guard:
            key = os.path.realpath(self.path)
            if (ref := self._held.get(key)) is not None and ref() is self:
                del self._held[key]
        try:
            os.ftruncate(fd, 0)  # before unlocking, so that no new holder's pid is wiped
        except OSError:
            pass
        _close(fd)

    def __repr__(self) -> str:
        return f"PrefixLock({self.prefix!r}, {'held' if self.held else 'released'})"


def _close(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)  # closing the last descriptor releases the flock
        except OSError:
            pass


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _check_writable(prefix: str) -> None:
    """One ConfigError naming ``model`` when its folder cannot hold checkpoint files."""
    directory = os.path.dirname(os.path.abspath(prefix))
    if os.path.isdir(prefix):
        raise ConfigError(f"config key 'model': {prefix!r} is a folder; 'model' is a path prefix of the checkpoint "
                          f"files, e.g. {os.path.join(prefix, 'model')!r}")
    try:
        os.makedirs(directory, exist_ok=True)
        fileio.check_writable(directory)
    except OSError as e:
        raise ConfigError(f"config key 'model': cannot write checkpoints under {prefix!r} "
                          f"(folder {directory!r}: {_why(e)})") from None


def _open_lock_file(prefix: str, path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ConfigError(f"config key 'model': cannot create the lock file {path!r} for {prefix!r} ({_why(e)})") from None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown (it is just starting)"
