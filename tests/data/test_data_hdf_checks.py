"""An HDF file is checked against its own description when it is opened: lengths, tags, sizes, data.

Every bad file gives a kit.DataError naming the file, the key and the first bad sequence; never data read
from shifted offsets, a raw KeyError / ValueError / IndexError, or a read that blocks.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kit.errors import DataError

h5py = pytest.importorskip("h5py", reason="HDFDataset needs h5py (kit's returnn/dev extra)")

from kit.data.hdf import HDFDataset, write_hdf  # noqa: E402


def _seqs(n=20, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(3, 12))
        out.append({"data": rng.standard_normal((t, 3)).astype(np.float32), "classes": rng.integers(0, 5, t)})
    return out


def _valid(path):
    seqs = _seqs()
    write_hdf(path, seqs, [f"t{i}" for i in range(len(seqs))])
    return seqs


def _replace(path, name, data):
    with h5py.File(path, "r+") as f:
        del f[name]
        f.create_dataset(name, data=data)


def _lengths(path):
    with h5py.File(path, "r") as f:
        return f["seqLengths"][...]


def test_a_valid_file_reads_back_what_was_written(tmp_path):  # the negative control
    path = tmp_path / "ok.hdf"
    seqs = _valid(path)
    ds = HDFDataset(str(path))
    for i, ref in enumerate(seqs):
        got = ds.get_seq(i)
        assert np.array_equal(got["data"], ref["data"]) and np.array_equal(got["classes"], ref["classes"])
    assert ds.all_tags() == [f"t{i}" for i in range(20)]


@pytest.mark.parametrize("case, expected", [
    ("negative", r"key 'data': seqLengths of sequence 3 is -2"),
    ("huge", r"seqLengths sum to .*first bad sequence: 3"),
    ("nan", r"key 'classes': seqLengths of sequence 3 is nan"),
    ("fraction", r"key 'data': seqLengths of sequence 3 is 2.5"),
    ("sum_more", r"key 'data': seqLengths sum to .*first bad sequence: 19"),
    ("sum_less", r"key 'classes': seqLengths sum to .* rows \(first bad sequence: 19\)"),
    ("bytes", r"seqLengths is of type \|S"),
    ("tags_short", r"seqTags holds 12 tags for 20 sequences \(first bad sequence: 12\)"),
    ("no_size", r"no 'targets/size'"),
    ("no_data", r"no 'targets/data'"),
    ("key_no_size", r"target key 'classes' has data but no size"),
])
def test_a_file_that_disagrees_with_itself_is_named(tmp_path, case, expected):
    path = tmp_path / f"{case}.hdf"
    _valid(path)
    lengths = _lengths(path).astype(np.int64)
    if case == "negative":
        lengths[3, 0] = -2
        _replace(path, "seqLengths", lengths)
    elif case == "huge":
        lengths[3, :] = 2**40
        _replace(path, "seqLengths", lengths)
    elif case in ("nan", "fraction"):
        flt = lengths.astype(np.float64)
        flt[3, 1 if case == "nan" else 0] = np.nan if case == "nan" else 2.5
        _replace(path, "seqLengths", flt)
    elif case == "sum_more":
        lengths[19, 0] += 1
        _replace(path, "seqLengths", lengths)
    elif case == "sum_less":
        lengths[19, 1] -= 1
        _replace(path, "seqLengths", lengths)
    elif case == "bytes":
        _replace(path, "seqLengths", np.array([[b"x13", b"7"]] * 20))
    elif case == "tags_short":
        _replace(path, "seqTags", np.array([f"t{i}".encode() for i in range(12)], dtype="S"))
    else:
        with h5py.File(path, "r+") as f:
            if case == "no_size":
                del f["targets/size"]
            elif case == "no_data":
                del f["targets/data"]
            else:
                del f["targets/size"].attrs["classes"]
    with pytest.raises(DataError, match=expected) as info:
        HDFDataset(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_special_files_are_refused_without_opening_them(tmp_path, kind):
    if kind == "fifo":
        path = str(tmp_path / "f.hdf")
        os.mkfifo(path)
    elif kind == "folder":
        path = str(tmp_path / "d.hdf")
        os.mkdir(path)
    else:
        path = "/dev/zero"
    result: list = []

    def open_it():
        try:
            HDFDataset(path)
        except DataError as e:
            result.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "blocked"
    assert result and path in str(result[0]) and "not a regular file" in str(result[0])
