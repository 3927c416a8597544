"""Test hook for killing a process mid-save: ``KIT_TEST_SLOW_WRITE_SECS`` slows every atomic write.

A test subprocess (the training script, a notebook kernel, a ``python -c`` saver) calls
:func:`install`; from then on each ``kit.fileio.atomic_open`` write sleeps that many seconds
after its data and before the rename, so the temp file exists while the test kills the
process. The variable is read at each write (a kernel may set and unset it between cells).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import IO

import kit.fileio

ENV = "KIT_TEST_SLOW_WRITE_SECS"


def install() -> None:
    """Wrap ``kit.fileio.atomic_open`` (once per process)."""
    real = kit.fileio.atomic_open
    if getattr(real, "slowed", False):
        return

    @contextlib.contextmanager
    def slowed(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
        with real(path, mode) as f:
            yield f
            f.flush()
            secs = os.environ.get(ENV)
            if secs:
                time.sleep(float(secs))

    slowed.slowed = True  # type: ignore[attr-defined]
    kit.fileio.atomic_open = slowed


def code(tests_dir: str) -> str:
    """Python source that installs the hook in a fresh interpreter (for ``python -c`` and kernels)."""
    return f"import sys; sys.path.insert(0, {tests_dir!r}); import helpers.slow_writes; helpers.slow_writes.install()"

