"""Which checkpoint files kit wrote: kit never overwrites or deletes a model file it did not write.

A model file without a manifest is either an interrupted kit save or somebody else's file
(RETURNN's ``model.NNN.pt`` in a run directory kit continues). kit's model files carry a
``kit_version`` entry; it is found in the pickle of the file's zip archive without unpickling
anything (the tensors live in other archive members, so this reads a few hundred bytes).
"""

from __future__ import annotations

import os
import zipfile


def written_by_kit(path: str) -> bool:
    """Whether the torch file at ``path`` was written by kit (its pickle names ``kit_version``).

    A file that is not a torch zip archive (truncated, empty, legacy format) counts as kit's when
    a temp-write leftover could explain it: it is not readable as anything else; so only a
    well-formed archive without ``kit_version`` is foreign.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                return True
            return b"kit_version" in archive.read(names[0])
    except (zipfile.BadZipFile, OSError, KeyError):
        return os.path.exists(path)


def foreign_file_error(path: str) -> str:
    return (f"{path} exists and was not written by kit (e.g. RETURNN's checkpoint); kit never overwrites "
            "or deletes a file it did not write — use another 'model' path or move the file")
