"""Fault injectors for file-safety tests: failing writers, simulated crashes, damaged files, evil pickles."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator
from typing import IO

import kit.fileio


class InjectedCrash(BaseException):
    """Stands for the process dying mid-write (BaseException: no ``except Exception`` swallows it)."""


class FailAfterNBytes:
    """A writable file object that accepts ``n_bytes`` and then fails.

    ``exc`` is raised on the write that crosses the limit (default: ``OSError(ENOSPC)``, a full disk);
    the bytes up to the limit reach the underlying file, as with a real partial write.
    """

    def __init__(self, f: IO[bytes], n_bytes: int, exc: BaseException | None = None):
        self._f = f
        self.remaining = n_bytes
        self.exc = exc if exc is not None else OSError(errno.ENOSPC, "No space left on device (injected)")
        self.failed = False

    def write(self, data: bytes) -> int:
        if len(data) > self.remaining:
            self._f.write(bytes(data[: self.remaining]))
            self.remaining = 0
            self.failed = True
            raise self.exc
        self.remaining -= len(data)
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def fail_writes_after(monkeypatch, n_bytes: int, match: Callable[[str], bool] = lambda p: True) -> list:
    """Make ``kit.fileio.atomic_open`` hand out writers failing after ``n_bytes`` for paths ``match``ing.

    The real ``atomic_open`` still runs around it, so its error path (temp removed) is exercised.
    Returns a list that collects the target paths of the failed writes.
    """
    real = kit.fileio.atomic_open
    failed: list[str] = []

    @contextlib.contextmanager
    def patched(path, mode="wb") -> Iterator[IO]:
        with real(path, mode) as f:
            if not match(os.fspath(path)):
                yield f
                return
            writer = FailAfterNBytes(f, n_bytes)
            try:
                yield writer
            finally:
                if writer.failed:
                    failed.append(os.fspath(path))

    monkeypatch.setattr(kit.fileio, "atomic_open", patched)
    return failed


def crash_writes_after(monkeypatch, n_bytes: int, match: Callable[[str], bool] = lambda p: True) -> list:
    """Like :func:`fail_writes_after`, but the "process dies": the partial temp file stays on disk
    and nothing is cleaned up, just as after ``kill -9`` or a power cut. Raises :class:`InjectedCrash`.

    Returns a list collecting the temp file paths left behind.
    """
    real = kit.fileio.atomic_open
    left: list[str] = []

    @contextlib.contextmanager
    def patched(path, mode="wb") -> Iterator[IO]:
        path = os.fspath(path)
        if not match(path):
            with real(path, mode) as f:
                yield f
            return
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + kit.fileio.TEMP_MARK, dir=directory)
        left.append(tmp)
        with os.fdopen(fd, mode) as f:
            yield FailAfterNBytes(f, n_bytes, InjectedCrash(f"injected crash while writing {path}"))
        raise AssertionError("crash_writes_after: the write finished below the byte limit")

    monkeypatch.setattr(kit.fileio, "atomic_open", patched)
    return left


def truncate_file(path: str | os.PathLike, keep: int | float = 0.5) -> int:
    """Cut ``path`` to ``keep`` bytes (int) or that fraction of its size (float); returns the new size."""
    size = os.path.getsize(path)
    new_size = int(size * keep) if isinstance(keep, float) else int(keep)
    os.truncate(path, new_size)
    return new_size


def flip_byte(path: str | os.PathLike, offset: int | None = None) -> int:
    """Invert one byte of ``path`` (default: the middle one); returns the offset."""
    data = bytearray(pathlib.Path(path).read_bytes())
    offset = len(data) // 2 if offset is None else offset % len(data)
    data[offset] ^= 0xFF
    pathlib.Path(path).write_bytes(bytes(data))
    return offset


def touch_marker(path: str) -> None:
    """Harmless payload of :class:`MaliciousPickle` with ``payload="touch"``: creates a marker file."""
    pathlib.Path(path).touch()


class MaliciousPickle:
    """Unpickling this runs code: it creates ``marker`` (via ``os.system`` or this module's ``touch_marker``)."""

    def __init__(self, marker: str | os.PathLike, payload: str = "os.system"):
        self.marker = os.fspath(marker)
        self.payload = payload

    def __reduce__(self):
        if self.payload == "os.system":
            return (os.system, (f"touch '{self.marker}'",))
        return (touch_marker, (self.marker,))


def write_malicious_checkpoint(
    path: str | os.PathLike, marker: str | os.PathLike, payload: str = "os.system"
) -> str:
    """A file that looks like a kit model file but whose unpickling would create ``marker``."""
    import torch

    torch.save(
        {"model": {"w": torch.zeros(2)}, "epoch": 1, "step": 1, "evil": MaliciousPickle(marker, payload)},
        os.fspath(path),
    )
    return os.fspath(path)


def write_code_carrying_file(path: str | os.PathLike, marker: str | os.PathLike, kind: str) -> str:
    """One of :data:`CODE_CARRYING_KINDS`: a file whose loading (without ``weights_only``) would run code.

    ``pickle-N``: a plain pickle of protocol N; ``legacy``: torch's pre-zip format; ``zip-system`` /
    ``zip-touch``: torch's zip format with an ``os.system`` / a test-module payload; ``torchscript``:
    a TorchScript archive; ``tar``: torch's legacy tar format; ``pickle-in-safetensors``: a pickle
    named ``.safetensors`` (``path`` gets that suffix).
    """
    import io
    import pickle
    import tarfile

    import torch

    path = os.fspath(path)
    evil = {"model": {"w": torch.zeros(2)}, "epoch": 1, "step": 1, "evil": MaliciousPickle(marker)}
    if kind.startswith("pickle-") and kind[7:].isdigit():
        with open(path, "wb") as f:
            pickle.dump({"model": MaliciousPickle(marker)}, f, protocol=int(kind[7:]))
    elif kind == "legacy":
        torch.save(evil, path, _use_new_zipfile_serialization=False)
    elif kind in ("zip-system", "zip-touch"):
        write_malicious_checkpoint(path, marker, "os.system" if kind == "zip-system" else "touch")
    elif kind == "torchscript":
        torch.jit.save(torch.jit.script(_Scripted()), path)
    elif kind == "tar":
        with tarfile.open(path, "w") as t:
            for name in ("storages", "tensors", "pickle"):
                data = pickle.dumps(MaliciousPickle(marker), protocol=2)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    elif kind == "pickle-in-safetensors":
        path = os.path.splitext(path)[0] + ".safetensors"
        with open(path, "wb") as f:
            pickle.dump({"w": MaliciousPickle(marker)}, f, protocol=2)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return path


CODE_CARRYING_KINDS = [*(f"pickle-{n}" for n in range(6)), "legacy", "zip-system", "zip-touch", "torchscript",
                       "tar", "pickle-in-safetensors"]


class _Scripted:  # built lazily: torch.nn needs torch imported
    def __new__(cls):  # noqa: D102
        import torch

        class Identity(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * 2

        return Identity()
