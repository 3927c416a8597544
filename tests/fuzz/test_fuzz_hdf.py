"""Fuzzing HDF files: a DataError naming the file, or exactly the sequences, tags and dims that were written."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from fuzzlib import MUTATIONS, mutate, outcome
from hypothesis import given, settings
from hypothesis import strategies as st

h5py = pytest.importorskip("h5py", reason="HDFDataset needs h5py (kit's returnn/dev extra)")

from kit.data.hdf import HDFDataset, write_hdf  # noqa: E402

CASES = 200


def _seqs():
    rng = np.random.default_rng(0)
    return [{"data": rng.standard_normal((int(t), 3)).astype(np.float32), "classes": rng.integers(0, 5, int(t))}
            for t in (3, 5, 2, 4, 6)]


SEQS = _seqs()
TAGS = [f"utt{i}" for i in range(len(SEQS))]


def _written() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "orig.hdf")
        write_hdf(path, SEQS, TAGS)
        with open(path, "rb") as f:
            return f.read()


ORIGINAL = _written()


def _read_all(path) -> dict:
    ds = HDFDataset(str(path))
    try:
        return {"seqs": [ds.get_seq(i) for i in range(ds.num_seqs)], "tags": ds.all_tags(),
                "tag0": ds.get_seq_tag(0) if ds.num_seqs else None, "dims": ds.dims, "sparse": ds.sparse,
                "lengths": [ds.get_seq_length(i) for i in range(ds.num_seqs)]}
    finally:
        ds.close()


def _assert_as_written(got: dict, *, tags: bool = True, keys: tuple = ("classes", "data"),
                       dims: dict | None = None) -> None:
    assert len(got["seqs"]) == len(SEQS), "a different number of sequences than written"
    for i, (seq, ref) in enumerate(zip(got["seqs"], SEQS)):
        ref = {k: v for k, v in ref.items() if k in keys}
        assert sorted(seq) == sorted(ref), f"sequence {i}: other keys"
        for key in ref:
            assert seq[key].dtype == ref[key].dtype and np.array_equal(seq[key], ref[key]), f"sequence {i}, {key}"
        assert got["lengths"][i] == {k: len(v) for k, v in ref.items()}
    assert got["dims"] == {k: v for k, v in {"data": 3, "classes": 5, **(dims or {})}.items() if k in keys}
    assert got["sparse"] == {k: v for k, v in {"data": False, "classes": True}.items() if k in keys}
    if tags:
        assert got["tags"] == TAGS and got["tag0"] == TAGS[0]


def _check(path, *, tags: bool = True, keys: tuple = ("classes", "data"), dims: dict | None = None) -> None:
    kind, value = outcome(lambda: _read_all(path), path)
    if kind == "value":
        _assert_as_written(value, tags=tags, keys=keys, dims=dims)


@settings(max_examples=CASES)
@given(mutations=MUTATIONS)
def test_fuzz_hdf_bytes(tmp_path, mutations):
    """Bit flips, truncation, overwritten and inserted bytes anywhere in the file."""
    path = tmp_path / "f.hdf"
    path.write_bytes(mutate(ORIGINAL, mutations))
    _check(path)


_DTYPES = ["int32", "int64", "uint8", "float32", "float64", "S4"]
_VALUES = st.one_of(st.integers(-(2**62), 2**62), st.sampled_from([0, 1, -1, 2**31, 2**40]),
                    st.floats(allow_nan=True, allow_infinity=True))
_EDIT = st.one_of(
    st.tuples(st.just("lengths"), st.sampled_from(_DTYPES), st.integers(0, 8), st.sampled_from([1, 2, 3]),
              st.lists(_VALUES, min_size=1, max_size=24)),
    st.tuples(st.just("tags"), st.integers(0, 8)),
    st.tuples(st.just("delete"), st.sampled_from(["targets/size", "targets/data", "targets/data/classes", "inputs",
                                                  "targets/labels", "targets"])),
    st.tuples(st.just("attr"), st.sampled_from(["inputPattSize", "classes"]),
              st.one_of(_VALUES, st.text(max_size=4), st.lists(st.integers(-3, 10), max_size=3))),
    st.tuples(st.just("frames"), st.sampled_from(["inputs", "targets/data/classes"]), st.integers(0, 40)),
)


def _edit(path, edit) -> bool:
    """Apply one structural edit with h5py; returns whether the tags are still the written ones."""
    kind, *args = edit
    with h5py.File(path, "r+") as f:
        if kind == "lengths":
            dtype, rows, cols, values = args
            flat = np.resize(np.array(values, dtype=object), rows * cols)
            if dtype.startswith("S"):
                arr = np.array([str(v).encode()[:4] for v in flat], dtype=dtype)
            else:
                with np.errstate(all="ignore"):
                    arr = np.array([_cast(v, dtype) for v in flat], dtype=dtype)
            del f["seqLengths"]
            f.create_dataset("seqLengths", data=arr.reshape(rows, cols) if cols > 1 else arr)
        elif kind == "tags":
            del f["seqTags"]
            f.create_dataset("seqTags", data=np.array([t.encode() for t in TAGS * 2][: args[0]], dtype="S"))
        elif kind == "delete":
            if args[0] in f:
                del f[args[0]]
            return args[0] != "seqTags"
        elif kind == "attr":
            name, value = args
            attrs = f.attrs if name == "inputPattSize" else f["targets/size"].attrs
            attrs[name] = np.array(value) if not isinstance(value, str) else value
        elif kind == "frames":  # the data's rows no longer what seqLengths describes
            name, rows = args
            data = f[name][...]
            del f[name]
            f.create_dataset(name, data=np.resize(data, (rows, *data.shape[1:])))
    return True


def _cast(value, dtype: str):
    try:
        return np.array(value).astype(dtype)
    except (OverflowError, ValueError):
        return 0


@settings(max_examples=CASES)
@given(edit=_EDIT)
def test_fuzz_hdf_structure(tmp_path, edit):
    """Inconsistent lengths, wrong dtypes, huge numbers, missing groups and sizes, data of other lengths."""
    path = tmp_path / "f.hdf"
    path.write_bytes(ORIGINAL)
    tags = _edit(path, edit)
    # without its 'targets' group the file is a valid file of the inputs alone (RETURNN's layout allows it)
    # an edited size is what the file says (a sparse key's dim cannot be checked without reading its labels)
    dims = {"data" if edit[1] == "inputPattSize" else "classes": _first(edit[2])} if edit[0] == "attr" else None
    _check(path, tags=tags, keys=("data",) if edit == ("delete", "targets") else ("classes", "data"), dims=dims)


def _first(value):
    try:
        return int(np.ravel(np.array(value))[0])
    except (ValueError, TypeError, IndexError, OverflowError):
        return None


def test_the_unmutated_file_reads_back_exactly(tmp_path):  # the negative control of the property
    path = tmp_path / "f.hdf"
    path.write_bytes(ORIGINAL)
    _assert_as_written(_read_all(path))
