"""RETURNN's dataset files and dicts read by kit give RETURNN's data, tags and orders.

HDF files are written by the installed RETURNN's own writers (``SimpleHDFWriter``,
``HDFDatasetWriter``) and read by both; kit's ``write_hdf`` files load in RETURNN.
Skips when RETURNN is not installed (CI installs it).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("h5py", reason="HDF parity needs h5py")
rdatasets = pytest.importorskip("returnn.datasets", reason="parity tests need RETURNN (pip install returnn)")
rhdf = pytest.importorskip("returnn.datasets.hdf")

from kit.data import make_dataset  # noqa: E402
from kit.data.hdf import write_hdf  # noqa: E402


def _seqs(n: int, seed: int, dim: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(2, 12))
        out.append(
            {
                "data": rng.standard_normal((t, dim)).astype(np.float32),
                "classes": rng.integers(0, 5, size=t).astype(np.int32),
                "align": rng.integers(0, 7, size=t + 2).astype(np.int32),
            }
        )
    return out


def _simple_writer_file(path, seqs, tag_prefix):
    writer = rhdf.SimpleHDFWriter(str(path), dim=seqs[0]["data"].shape[1], ndim=2)
    for i, s in enumerate(seqs):
        writer.insert_batch(
            s["data"][None],
            seq_len=[len(s["data"])],
            seq_tag=[f"{tag_prefix}-{i}"],
            extra={"classes": s["classes"][None]},
        )
    writer.close()
    return str(path)


def _returnn_read(opts, epoch=1):
    ds = rdatasets.init_dataset({"random_seed_offset": 0, **opts})
    ds.init_seq_order(epoch=epoch)
    out = []
    i = 0
    while ds.is_less_than_num_seqs(i):
        ds.load_seqs(i, i + 1)
        out.append((ds.get_tag(i), {k: np.asarray(ds.get_data(i, k)) for k in ds.get_data_keys()}))
        i += 1
    return out


def _kit_read(opts, epoch=1):
    ds = make_dataset(dict(opts) if isinstance(opts, dict) else opts)
    ds.init_epoch(epoch)
    return [(ds.get_seq_tag(i), ds.get_seq(i)) for i in ds.get_seq_order(epoch)]


def _assert_same(kit_seqs, returnn_seqs):
    assert [t for t, _ in kit_seqs] == [t for t, _ in returnn_seqs]
    for (_, a), (tag, b) in zip(kit_seqs, returnn_seqs):
        assert sorted(a) == sorted(b), tag
        for key in b:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), (tag, key)


@pytest.mark.parametrize("ordering", ["default", "sorted", "random", "laplace:.4", "sort_bin_shuffle:.4"])
def test_simple_hdf_writer_files_equal_returnn(tmp_path, ordering):
    files = [
        _simple_writer_file(tmp_path / "a.hdf", _seqs(9, 0), "a"),
        _simple_writer_file(tmp_path / "b.hdf", _seqs(6, 1), "b"),
    ]
    opts = {"class": "HDFDataset", "files": files, "seq_ordering": ordering}
    for epoch in (1, 2):
        _assert_same(_kit_read(opts, epoch), _returnn_read({**opts, "cache_byte_size": 0}, epoch))


def test_hdf_dataset_writer_files_equal_returnn(tmp_path):
    """HDFDatasetWriter dumps a RETURNN dataset (keys of different lengths, sparse and dense)."""
    data = _seqs(7, 2)
    src = rdatasets.init_dataset({"class": "StaticDataset", "data": data, "output_dim": {"classes": (5, 1), "align": (7, 1), "data": (3, 2)}})
    path = str(tmp_path / "dump.hdf")
    writer = rhdf.HDFDatasetWriter(path)
    writer.dump_from_dataset(src, use_progress_bar=False)
    writer.close()
    opts = {"class": "HDFDataset", "files": [path], "seq_ordering": "random"}
    kit_seqs = _kit_read(opts, 3)
    _assert_same(kit_seqs, _returnn_read({**opts, "cache_byte_size": 0}, 3))
    assert {k for k in kit_seqs[0][1]} == {"data", "classes", "align"}


def test_kit_written_hdf_loads_in_returnn(tmp_path):
    path = str(tmp_path / "kit.hdf")
    seqs = _seqs(5, 3)
    write_hdf(path, seqs, tags=[f"utt{i}" for i in range(5)])
    opts = {"class": "HDFDataset", "files": [path]}
    returnn_seqs = _returnn_read({**opts, "cache_byte_size": 0})
    _assert_same(_kit_read(opts), returnn_seqs)
    assert np.array_equal(returnn_seqs[4][1]["align"], seqs[4]["align"])


def test_negative_control_other_epoch_differs(tmp_path):
    files = [_simple_writer_file(tmp_path / "a.hdf", _seqs(9, 0), "a")]
    opts = {"class": "HDFDataset", "files": files, "seq_ordering": "random"}
    with pytest.raises(AssertionError):
        _assert_same(_kit_read(opts, 1), _returnn_read({**opts, "cache_byte_size": 0}, 2))


def _write_split(tmp_path, seqs):
    """features in one file, alignments (other tag order) in another: MetaDataset joins them by tag."""
    tags = [f"utt-{i}" for i in range(len(seqs))]
    write_hdf(tmp_path / "feat.hdf", [{"data": s["data"]} for s in seqs], tags)
    perm = np.random.default_rng(5).permutation(len(seqs))
    write_hdf(tmp_path / "align.hdf", [{"classes": seqs[i]["classes"]} for i in perm], [tags[i] for i in perm])
    return str(tmp_path / "feat.hdf"), str(tmp_path / "align.hdf")


@pytest.mark.parametrize("control", [True, False])
@pytest.mark.parametrize("ordering", ["random", "laplace:.3", "sorted_reverse"])
def test_meta_dataset_equals_returnn(tmp_path, control, ordering):
    feat, align = _write_split(tmp_path, _seqs(11, 4))
    sub_opts = {"seq_ordering": ordering} if control else {}
    opts = {
        "class": "MetaDataset",
        "datasets": {
            "feat": {"class": "HDFDataset", "files": [feat], "cache_byte_size": 0, **sub_opts},
            "align": {"class": "HDFDataset", "files": [align], "cache_byte_size": 0},
        },
        "data_map": {"data": ("feat", "data"), "classes": ("align", "classes")},
        **({"seq_order_control_dataset": "feat"} if control else {"seq_ordering": ordering}),
    }
    for epoch in (1, 2):
        _assert_same(_kit_read(opts, epoch), _returnn_read(opts, epoch))


def test_concat_and_static_datasets_equal_returnn():
    parts = [
        {"class": "StaticDataset", "data": _seqs(6, 6), "seq_ordering": "random"},
        {"class": "StaticDataset", "data": _seqs(4, 7), "seq_ordering": "sorted"},
    ]
    opts = {"class": "ConcatDataset", "datasets": parts}
    for epoch in (1, 4):
        _assert_same(_kit_read(opts, epoch), _returnn_read(opts, epoch))
    static = {"class": "StaticDataset", "data": _seqs(9, 8), "seq_ordering": "laplace:.3", "partition_epoch": 2}
    for epoch in (1, 2, 3):
        _assert_same(_kit_read(static, epoch), _returnn_read(static, epoch))


@pytest.mark.parametrize(
    "opts",
    [
        {},  # new sequences every epoch
        {"fixed_random_seed": 3},
        {"seq_ordering": "random", "partition_epoch": 2},
        {"seq_ordering": "random:2", "random_seed_offset": 5},
    ],
)
def test_task12ax_sequences_equal_returnn(opts):
    spec = {"class": "Task12AXDataset", "num_seqs": 12, **opts}
    for epoch in (1, 2, 3):
        kit_seqs, returnn_seqs = _kit_read(spec, epoch), _returnn_read(spec, epoch)
        assert [t for t, _ in kit_seqs] == [t for t, _ in returnn_seqs]
        for (_, a), (_, b) in zip(kit_seqs, returnn_seqs):
            assert np.array_equal(a["data"], b["data"]) and np.array_equal(a["classes"], b["classes"])


def sub_epoch_hdf(files):
    return {"class": "HDFDataset", "files": list(files), "seq_ordering": "laplace:.3", "cache_byte_size": 0}


@pytest.mark.parametrize("ordering", ["random", "default"])
def test_distribute_files_dataset_equals_returnn(tmp_path, ordering):
    files = []
    for i, n in enumerate([3, 7, 2, 5, 4, 6, 3]):
        path = tmp_path / f"part{i}.hdf"
        write_hdf(path, _seqs(n, 10 + i), [f"p{i}-{j}" for j in range(n)])
        files.append(str(path))
    opts = {
        "class": "DistributeFilesDataset",
        "files": files,
        "get_sub_epoch_dataset": sub_epoch_hdf,
        "partition_epoch": 3,
        "seq_ordering": ordering,
    }
    for epoch in range(1, 8):
        _assert_same(_kit_read(opts, epoch), _returnn_read({**opts, "use_worker_proc": False}, epoch))


def test_files_distributed_over_sub_epochs_as_in_returnn():
    from returnn.datasets.distrib_files import DistributeFilesDataset as ReturnnDFD

    from kit.data.distrib_files import distribute_by_size

    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 25))
        sizes = [int(s) for s in rng.integers(1, 200, size=n)] if trial % 3 else [5, 5] + [10] * (n % 8)
        for num_bins in range(1, len(sizes) + 1):
            names = [f"f{i}" for i in range(len(sizes))]
            ref = ReturnnDFD._distribute_evenly_by_size(
                num_bins=num_bins, file_sizes=dict(zip(names, sizes)), files_order=names
            )
            assert [[names[i] for i in b] for b in distribute_by_size(sizes, num_bins)] == ref, (sizes, num_bins)


@pytest.mark.parametrize("workers", [0, 1])
def test_other_returnn_classes_come_through_returnns_api(workers):
    """CopyTaskDataset has no kit class: adapted, it gives RETURNN's sequences batch by batch."""
    import torch

    from kit.data import Pipeline
    from kit.data.returnn_adapter import ReturnnDataset

    spec = {"class": "CopyTaskDataset", "nsymbols": 5, "minlen": 2, "maxlen": 9, "num_seqs": 14, "seq_ordering": "random"}
    ds = make_dataset(spec)
    assert isinstance(ds, ReturnnDataset)
    pipe = Pipeline(ds, batch_size=30, num_workers=workers)
    try:
        for epoch in (1, 2):
            pipe.set_epoch(epoch)
            got = [(tag, batch["data"].tensor[row, : int(batch["data"].lengths[row])]) for batch in pipe for row, tag in enumerate(batch.seq_tags)]
            ref = _returnn_read(spec, epoch)
            assert [t for t, _ in got] == [t for t, _ in ref]
            assert all(torch.equal(x, torch.as_tensor(r["data"]).to(x.dtype)) for (_, x), (_, r) in zip(got, ref))
    finally:
        pipe.close()
    obj = rdatasets.init_dataset({**spec, "random_seed_offset": 0})
    assert [t for t, _ in _kit_read(obj, 3)] == [t for t, _ in _returnn_read(spec, 3)]
