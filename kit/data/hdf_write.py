"""``write_hdf``: sequences written in RETURNN's HDF layout, checksummed, for kit's and RETURNN's ``HDFDataset``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from kit.data.dataset import SeqDict
from kit.errors import DataError

_CHECKSUMMED: dict[str, Any] = {"fletcher32": True, "chunks": True}


def write_hdf(path: str | os.PathLike[str], seqs: Sequence[SeqDict], tags: Sequence[str] | None = None) -> None:
    """Write sequences in RETURNN's HDF layout (``data`` as ``inputs``, other keys as targets).

    The file loads in kit's and in RETURNN's ``HDFDataset``. Every key needs a time axis
    (shape ``[T, ...]``); 1-d integer keys are sparse, their dim is their maximum + 1.
    """
    import h5py  # type: ignore[import-untyped]

    if not seqs:
        raise DataError(f"write_hdf({os.fspath(path)!r}): no sequences")
    keys = sorted(seqs[0])
    targets = sorted(k for k in keys if k != "data")
    tags = [f"seq-{i}" for i in range(len(seqs))] if tags is None else [str(t) for t in tags]
    lengths = np.array(
        [[int(np.shape(s[k])[0]) for k in (["data"] if "data" in keys else []) + (targets or [])] for s in seqs],
        dtype=np.int32,
    )
    # libver="latest": object headers (attributes, sizes) carry checksums; fletcher32: so does each chunk of
    # data. A flipped bit is then an error when read, never a different number (RETURNN's reader reads them too).
    with h5py.File(os.fspath(path), "w", libver="latest") as fout:
        fout.attrs.update({"numSeqs": len(seqs), "numDims": 1, "numTimesteps": int(lengths[:, 0].sum())})
        fout.create_dataset("seqLengths", data=lengths if targets else np.c_[lengths, lengths], **_CHECKSUMMED)
        fout.create_dataset("seqTags", data=np.array([t.encode("utf-8") for t in tags], dtype="S"), **_CHECKSUMMED)
        for key in keys:
            arr = np.concatenate([np.asarray(s[key]) for s in seqs], axis=0)
            dim = int(arr.max()) + 1 if arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer) else arr.shape[-1]
            if key == "data":
                fout.create_dataset("inputs", data=arr, **_CHECKSUMMED)
                fout.attrs["inputPattSize"] = dim
                fout.attrs["numLabels"] = dim
            else:
                fout.create_dataset(f"targets/data/{key}", data=arr, **_CHECKSUMMED)
                fout.require_group("targets/size").attrs[key] = [dim, arr.ndim]
                fout.require_group("targets/labels")
