"""Which checkpoint files kit wrote: kit never overwrites or deletes a model file it did not write.

A model file without a manifest is either an interrupted kit save or somebody else's file
(RETURNN's ``model.NNN.pt`` in a run directory kit continues). kit's model files carry a
``kit_version`` entry and its training-state files ``kit_version`` (or, written by an older kit,
``progress`` and ``rng``); they are found in the pickle of the file's zip archive without
unpickling anything (the tensors live in other archive members, so this reads a few hundred bytes).

kit writes every file through a temp file and a rename, so a file that is not a readable torch
archive (truncated, damaged, another format) was never written under that name by kit: it is
somebody else's, and stays untouched.
"""

from __future__ import annotations

import os
import stat
import zipfile

_MAX_PICKLE_BYTES = 64 << 20  # a data.pkl larger than this is not a checkpoint's small index


def written_by_kit(path: str) -> bool:
    """Whether the torch file at ``path`` was written by kit (its pickle names kit's entries).

    False for a file that is not a well-formed torch archive (damaged, truncated, a special file):
    kit never leaves such a file under a checkpoint name, so it is not kit's to replace.
    """
    pickle = _index_of(path)
    return pickle is not None and (b"kit_version" in pickle or (b"progress" in pickle and b"rng" in pickle))


def has_entry(path: str, name: str) -> bool:
    """Whether the torch file at ``path`` names ``name`` in its index (a cheap test before loading it)."""
    pickle = _index_of(path)
    return pickle is not None and name.encode() in pickle


def _index_of(path: str) -> bytes | None:
    """The pickle of a torch zip archive (its small index; tensors are other members), or None."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with zipfile.ZipFile(path) as archive:
            infos = [i for i in archive.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if not infos or infos[0].file_size > _MAX_PICKLE_BYTES:
                return None
            return archive.read(infos[0])
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, KeyError, ValueError, EOFError, RuntimeError):
        return None


def foreign_files(paths: list[str]) -> list[str]:
    """Those of ``paths`` that exist and were not written by kit."""
    return [p for p in paths if os.path.lexists(p) and not written_by_kit(p)]


def foreign_file_error(path: str) -> str:
    return (f"{path} exists and was not written by kit (e.g. RETURNN's checkpoint, or a damaged file); kit never "
            "overwrites or deletes a file it did not write — move the file away (e.g. rename it to "
            f"{os.path.basename(path)}.bak) or use another 'model' path")
