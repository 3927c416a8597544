"""Rows read from an HDF file's bytes (kit.data.hdf_raw) are exactly h5py's, and reading opens no HDF5 file.

RETURNN's SimpleHDFWriter writes unfiltered chunked datasets; HDFDataset reads their sequences with a
positional read where HDF5 stores them plainly, and through h5py everywhere else (filters, chunks never
written). A file changed or cut short under a dataset is a DataError naming it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kit.errors import DataError

h5py = pytest.importorskip("h5py", reason="HDFDataset needs h5py (kit's returnn/dev extra)")

from kit.data import hdf_raw  # noqa: E402
from kit.data.hdf import HDFDataset  # noqa: E402

needs_preadv = pytest.mark.skipif(not hasattr(os, "preadv"), reason="positional reads need os.preadv (not on Windows)")


def _seqs(n=30, dim=7, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, size=n)
    return [{"data": rng.standard_normal((t, dim)).astype(dtype), "classes": rng.integers(0, 9, t).astype(np.int32)}
            for t in lens]


def write_returnn_layout(path, seqs, *, chunks=(13, 3), class_chunks=(17,), reverse=False, **dataset_opts):
    """RETURNN's layout as SimpleHDFWriter writes it (resizable chunked datasets), with chosen chunk shapes;
    ``reverse``: the sequences are written last to first, so the chunks lie in the file out of order."""
    data = np.concatenate([s["data"] for s in seqs])
    classes = np.concatenate([s["classes"] for s in seqs])
    lens = np.array([[len(s["data"]), len(s["classes"])] for s in seqs], dtype=np.int32)
    with h5py.File(path, "w") as f:
        f.attrs.update({"inputPattSize": data.shape[1], "numLabels": 9, "numSeqs": len(seqs)})
        f.create_dataset("seqLengths", data=lens)
        f.create_dataset("seqTags", data=np.array([f"s{i}".encode() for i in range(len(seqs))], dtype="S"))
        inputs = f.create_dataset("inputs", shape=data.shape, maxshape=(None, data.shape[1]), dtype=data.dtype,
                                  chunks=chunks, **dataset_opts)
        cls = f.create_dataset("targets/data/classes", shape=classes.shape, maxshape=(None,), dtype=np.int32,
                               chunks=class_chunks, **dataset_opts)
        f.create_group("targets/size").attrs["classes"] = 9
        f.create_group("targets/labels")
        ends = np.cumsum(lens[:, 0])
        order = range(len(seqs) - 1, -1, -1) if reverse else range(len(seqs))
        for i in order:
            a, b = int(ends[i] - lens[i, 0]), int(ends[i])
            inputs[a:b], cls[a:b] = data[a:b], classes[a:b]


def _assert_reads_as_h5py(ds, path):
    with h5py.File(path, "r") as f:
        ends = np.concatenate([[0], np.cumsum(f["seqLengths"][:, 0])])
        for i in range(ds.num_seqs):
            got = ds.get_seq(i)
            for key, name in (("data", "inputs"), ("classes", "targets/data/classes")):
                ref = f[name][int(ends[i]) : int(ends[i + 1])]
                assert got[key].dtype == ref.dtype and got[key].shape == ref.shape, (i, key)
                assert got[key].flags.c_contiguous, (i, key)
                assert np.array_equal(got[key], ref), (i, key)


@needs_preadv
@pytest.mark.parametrize("case, opts", [
    ("chunks across the width", {"chunks": (13, 3)}),  # 7 features: the last column of chunks is partly padding
    ("chunks as wide as a row", {"chunks": (5, 7)}),
    ("chunks dividing the width", {"chunks": (5, 2), "dim": 8}),  # each row of chunks copied at once
    ("one row per chunk", {"chunks": (1, 7), "class_chunks": (1,)}),
    ("chunks out of order in the file", {"chunks": (13, 3), "reverse": True}),
    ("big-endian float64", {"chunks": (8, 4), "dtype": ">f8"}),
    ("contiguous", {"chunks": None}),
])
def test_raw_reads_equal_h5py(tmp_path, case, opts):
    opts = dict(opts)
    seqs = _seqs(dim=opts.pop("dim", 7), dtype=np.dtype(opts.pop("dtype", np.float32)))
    path = str(tmp_path / "x.hdf")
    if opts.get("chunks") is None:  # h5py's default: one contiguous block per dataset
        _write_contiguous(path, seqs)
    else:
        write_returnn_layout(path, seqs, **opts)
    ds = HDFDataset(path)
    with h5py.File(path, "r") as f:
        assert hdf_raw.raw_layout(f["inputs"]) is not None  # the test reads through the raw path
    _assert_reads_as_h5py(ds, path)


def _write_contiguous(path, seqs):
    data = np.concatenate([s["data"] for s in seqs])
    classes = np.concatenate([s["classes"] for s in seqs])
    lens = np.array([[len(s["data"]), len(s["classes"])] for s in seqs], dtype=np.int32)
    with h5py.File(path, "w") as f:
        f.attrs["inputPattSize"] = data.shape[1]
        f.create_dataset("seqLengths", data=lens)
        f.create_dataset("inputs", data=data)
        f.create_dataset("targets/data/classes", data=classes)
        f.create_group("targets/size").attrs["classes"] = 9


@needs_preadv
@pytest.mark.parametrize("dim, chunks", [(7, (13, 3)), (8, (5, 2))])
def test_chunks_far_apart_are_read_one_by_one(tmp_path, monkeypatch, dim, chunks):
    """Chunks further apart than SPAN_SLACK times their size are read each on its own, with the same rows."""
    monkeypatch.setattr(hdf_raw, "SPAN_SLACK", 0)
    path = str(tmp_path / "x.hdf")
    write_returnn_layout(path, _seqs(dim=dim), chunks=chunks, reverse=True)
    _assert_reads_as_h5py(HDFDataset(path), path)


def test_filtered_and_unwritten_data_is_read_through_h5py(tmp_path):
    """Compressed chunks have no raw layout; a chunk never written is h5py's fill value. Both read as h5py."""
    seqs = _seqs()
    zipped = str(tmp_path / "zipped.hdf")
    write_returnn_layout(zipped, seqs, compression="gzip")
    with h5py.File(zipped, "r") as f:
        assert hdf_raw.raw_layout(f["inputs"]) is None
    _assert_reads_as_h5py(HDFDataset(zipped), zipped)

    holes = str(tmp_path / "holes.hdf")
    write_returnn_layout(holes, seqs)
    with h5py.File(holes, "r+") as f:  # a dataset one chunk longer than written: the last sequence has a hole
        lens = f["seqLengths"][...]
        lens[-1] += 13
        del f["seqLengths"]
        f.create_dataset("seqLengths", data=lens)
        for name in ("inputs", "targets/data/classes"):
            f[name].resize(f[name].shape[0] + 13, axis=0)
    ds = HDFDataset(holes)
    assert np.all(ds.get_seq(ds.num_seqs - 1)["data"][-13:] == 0)
    _assert_reads_as_h5py(ds, holes)


@needs_preadv
def test_reading_many_files_opens_no_hdf5_file(tmp_path, monkeypatch):
    """After the index, 40 files (more than MAX_OPEN_FILES) are read in any order without one HDF5 open,
    and with at most MAX_FDS file descriptors; close() gives them back."""
    paths = []
    for k in range(40):
        paths.append(str(tmp_path / f"f{k}.hdf"))
        write_returnn_layout(paths[-1], _seqs(n=3, seed=k))
    monkeypatch.setattr(hdf_raw, "MAX_FDS", 8)
    ds = HDFDataset(paths)
    opened = []
    real = h5py.File
    monkeypatch.setattr(h5py, "File", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    order = np.random.default_rng(0).permutation(ds.num_seqs)
    got = {int(i): ds.get_seq(int(i)) for i in order}
    assert opened == []
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) - fds <= 8
    monkeypatch.setattr(h5py, "File", real)
    for k in range(40):
        for s, ref in enumerate(_seqs(n=3, seed=k)):
            assert np.array_equal(got[3 * k + s]["data"], ref["data"])
            assert np.array_equal(got[3 * k + s]["classes"], ref["classes"])
    ds.close()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds


@needs_preadv
@pytest.mark.parametrize("how", ["rewritten in place", "replaced by rename"])
def test_a_file_changed_under_the_dataset_is_an_error_naming_it(tmp_path, how):
    path = str(tmp_path / "x.hdf")
    write_returnn_layout(path, _seqs())
    ds = HDFDataset(path)
    ds.close()
    if how == "rewritten in place":  # the index no longer describes it
        write_returnn_layout(path, _seqs(n=31, seed=1))
    else:  # another file, as a tool that writes a new file and renames it over the old one leaves it
        write_returnn_layout(str(tmp_path / "new.hdf"), _seqs(seed=1))
        os.replace(tmp_path / "new.hdf", path)
    with pytest.raises(DataError, match=r"x\.hdf changed since its index was read"):
        ds.get_seq(0)


@needs_preadv
def test_a_file_cut_short_under_the_dataset_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "x.hdf")
    _write_contiguous(path, _seqs())
    ds = HDFDataset(path)
    ds.get_seq(0)  # its descriptor is open now
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(DataError, match=r"x\.hdf.*(cut short|changed since)"):
        for i in range(ds.num_seqs):
            ds.get_seq(i)


@needs_preadv
def test_returnns_own_writer_is_read_through_the_raw_path(tmp_path):
    """The files RETURNN setups have (SimpleHDFWriter) take the positional reads, with h5py's values."""
    rhdf = pytest.importorskip("returnn.datasets.hdf", reason="RETURNN writes the file")
    path = str(tmp_path / "returnn.hdf")
    seqs = _seqs(n=12)
    writer = rhdf.SimpleHDFWriter(path, dim=7, ndim=2, extra_type={"classes": (9, 1, "int32")})
    for i, s in enumerate(seqs):
        writer.insert_batch(s["data"][None], seq_len={0: [len(s["data"])]}, seq_tag=[f"s{i}"],
                            extra={"classes": s["classes"][None]})
    writer.close()
    ds = HDFDataset(path)
    with h5py.File(path, "r") as f:
        assert hdf_raw.raw_layout(f["inputs"]) is not None
        assert hdf_raw.raw_layout(f["targets/data/classes"]) is not None
    _assert_reads_as_h5py(ds, path)
    for i, s in enumerate(seqs):
        assert np.array_equal(ds.get_seq(i)["data"], s["data"])


@needs_preadv
def test_a_large_dataset_is_mapped_on_its_files_second_read(tmp_path, monkeypatch):
    """Mapping a big file's chunks (~1 us each) waits until the file is read again: the epoch's first batch
    reads through h5py; the values are the same either way."""
    monkeypatch.setattr(hdf_raw, "SOON_CHUNKS", 0)  # every chunked dataset counts as large
    path = str(tmp_path / "x.hdf")
    write_returnn_layout(path, _seqs())
    mapped = []
    real = hdf_raw.raw_layout
    monkeypatch.setattr("kit.data.hdf.raw_layout", lambda ds: mapped.append(ds.name) or real(ds))
    ds = HDFDataset(path)
    assert mapped == []
    first = ds.get_seq(3)
    assert mapped == []
    ds.get_seq(4)
    assert sorted(mapped) == ["/inputs", "/targets/data/classes"]
    assert np.array_equal(first["data"], ds.get_seq(3)["data"])
    _assert_reads_as_h5py(ds, path)
