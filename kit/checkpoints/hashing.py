"""Checkpoint files with their sha256: written while hashed (:func:`write_torch_file`), hashed while read
(:func:`hash_in_background`, :func:`sha256_of`), so that a manifest's digest costs no second pass over the file."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
from collections.abc import Callable
from typing import IO, Any

import torch

from kit import fileio
from kit.errors import CorruptCheckpointError

_HASH_CHUNK = 8 << 20


class _HashingWriter:
    """Passes writes through to ``f`` while counting bytes and computing sha256.

    A large write is hashed in a helper thread while the main thread writes the same buffer
    (both run without the GIL); the call returns when both are done, so the buffer torch
    hands over never needs copying.
    """

    _PARALLEL_FROM = 1 << 20  # bytes; smaller writes are hashed inline

    def __init__(self, f: IO[bytes], pool: concurrent.futures.Executor):
        self._f = f
        self._pool = pool
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None

    def write(self, data: bytes) -> int:
        hashing = None
        if len(data) >= self._PARALLEL_FROM:
            hashing = self._pool.submit(self.sha256.update, data)
        else:
            self.sha256.update(data)
        self.size += len(data)
        try:
            return self._f.write(data)
        except BaseException as e:
            self.error = e
            raise
        finally:
            if hashing is not None:
                hashing.result()

    def flush(self) -> None:
        self._f.flush()


def write_torch_file(path: str, obj: Any) -> dict:
    """Atomically ``torch.save`` ``obj`` to ``path``; returns its manifest entry."""
    with (
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kit-checkpoint-sha256") as pool,
        fileio.atomic_open(path, "wb") as f,
    ):
        writer = _HashingWriter(f, pool)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]  # a file-like writer (write, flush)
        except BaseException:
            # torch's zip writer replaces a failed write (e.g. ENOSPC) by an opaque "unexpected pos"
            if writer.error is not None:
                raise writer.error from None
            raise
    return {"name": os.path.basename(path), "size": writer.size, "sha256": writer.sha256.hexdigest()}


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_in_background(paths: list[str]) -> Callable[[], list[str]]:
    """Start hashing ``paths`` in a thread (sha256 and file reads run without the GIL, so this
    overlaps with ``torch.load``); the returned function waits and gives the digests."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["digests"] = [sha256_of(p) for p in paths]
        except BaseException as e:  # handed to the waiting thread
            result["error"] = e

    thread = threading.Thread(target=work, name="kit-checkpoint-sha256", daemon=True)
    thread.start()

    def wait() -> list[str]:
        thread.join()
        if "error" in result:
            raise CorruptCheckpointError(f"Cannot read checkpoint files for hashing: {result['error']}")
        return result["digests"]

    return wait
