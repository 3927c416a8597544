"""RETURNN's dataset classes in kit (without RETURNN installed): HDF, Static, Concat, Meta, 12AX per epoch."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from kit.data import Pipeline, Task12AXDataset, make_dataset
from kit.errors import ConfigError, DataError

h5py = pytest.importorskip("h5py", reason="HDFDataset needs h5py (kit's returnn/dev extra)")

from kit.data.hdf import HDFDataset, write_hdf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def seqs(n, seed=0, dim=4):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(3, 30))
        out.append({"data": rng.standard_normal((t, dim)).astype(np.float32), "classes": rng.integers(0, 6, t)})
    return out


def test_import_kit_loads_neither_h5py_nor_returnn():
    code = "import json, sys, kit, kit.data\nprint(json.dumps([m for m in ('h5py', 'returnn') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_hdf_round_trip_over_several_files(tmp_path):
    a, b = seqs(5, 1), seqs(3, 2)
    write_hdf(tmp_path / "a.hdf", a, [f"a{i}" for i in range(5)])
    write_hdf(tmp_path / "b.hdf", b, [f"b{i}" for i in range(3)])
    ds = make_dataset({"class": "HDFDataset", "files": [str(tmp_path / "a.hdf"), str(tmp_path / "b.hdf")]})
    assert len(ds) == 8 and ds.get_seq_tag(6) == "b1" and ds.get_seq_index("a4") == 4
    for i, ref in enumerate(a + b):
        got = ds.get_seq(i)
        assert np.array_equal(got["data"], ref["data"]) and np.array_equal(got["classes"], ref["classes"])
        assert ds.get_seq_length(i) == {"data": len(ref["data"]), "classes": len(ref["classes"])}
    assert ds.extern_data == {"data": {"shape": (None, 4)}, "classes": {"shape": (None,), "sparse_dim": 6}}


def test_hdf_reads_lazily(tmp_path):
    """Opening a 16 MB file and reading one sequence allocates a tiny fraction of it."""
    big = [{"data": np.ones((2000, 64), np.float32)} for _ in range(32)]
    write_hdf(tmp_path / "big.hdf", big)
    size = (tmp_path / "big.hdf").stat().st_size
    tracemalloc.start()
    ds = HDFDataset([str(tmp_path / "big.hdf")])
    first = ds.get_seq(3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert first["data"].shape == (2000, 64)
    assert peak < size / 10, (peak, size)


def test_hdf_pickles_without_open_files_and_trains_with_workers(tmp_path):
    write_hdf(tmp_path / "a.hdf", seqs(40, 3))
    ds = HDFDataset([str(tmp_path / "a.hdf")], seq_ordering="laplace:.5")
    ds.get_seq(0)  # a file is open now
    again = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(again.get_seq(7)["data"], ds.get_seq(7)["data"])
    ref = Pipeline(ds, batch_size=100)
    par = Pipeline(ds, batch_size=100, num_workers=1)
    try:
        for epoch in (1, 2):
            ref.set_epoch(epoch)
            par.set_epoch(epoch)
            for x, y in zip(list(ref), list(par), strict=True):
                assert x.seq_idx == y.seq_idx and torch.equal(x["data"].tensor, y["data"].tensor)
    finally:
        par.close()


def test_hdf_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="missing.hdf"):
        HDFDataset([str(tmp_path / "missing.hdf")])
    with h5py.File(tmp_path / "other.hdf", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DataError, match="not a RETURNN HDF file"):
        HDFDataset(str(tmp_path / "other.hdf"))
    with pytest.raises(ConfigError, match="did you mean 'files'"):
        make_dataset({"class": "HDFDataset", "file": ["x.hdf"]})


def test_meta_dataset_joins_by_tag_and_names_missing_ones(tmp_path):
    data = seqs(6, 4)
    tags = [f"utt{i}" for i in range(6)]
    write_hdf(tmp_path / "f.hdf", [{"data": s["data"]} for s in data], tags)
    write_hdf(tmp_path / "c.hdf", [{"classes": s["classes"]} for s in data][::-1], tags[::-1])
    spec = {
        "class": "MetaDataset",
        "datasets": {
            "f": {"class": "HDFDataset", "files": [str(tmp_path / "f.hdf")]},
            "c": {"class": "HDFDataset", "files": [str(tmp_path / "c.hdf")]},
        },
        "data_map": {"data": ("f", "data"), "classes": ("c", "classes")},
        "seq_ordering": "sorted",
    }
    meta = make_dataset(spec)
    for i in range(6):
        assert np.array_equal(meta.get_seq(i)["classes"], data[i]["classes"])
    lens = [len(data[i]["data"]) for i in meta.get_seq_order(1)]
    assert lens == sorted(lens)
    write_hdf(tmp_path / "c5.hdf", [{"classes": s["classes"]} for s in data[:5]], tags[:5])
    spec["datasets"]["c"] = {"class": "HDFDataset", "files": [str(tmp_path / "c5.hdf")]}
    with pytest.raises(DataError, match="'utt5' .* missing in dataset 'c'"):
        make_dataset(spec).get_seq(0)
    with pytest.raises(ConfigError, match="not in 'datasets'"):
        make_dataset({**spec, "data_map": {"data": ("nope", "data")}})


def test_concat_and_static():
    parts = [{"class": "StaticDataset", "data": seqs(3, 5)}, {"class": "StaticDataset", "data": seqs(2, 6)}]
    ds = make_dataset({"class": "ConcatDataset", "datasets": parts})
    assert len(ds) == 5 and ds.get_seq_order(1) == [0, 1, 2, 3, 4]
    assert [ds.get_seq_tag(i) for i in range(5)] == ["seq-0", "seq-1", "seq-2", "seq-0", "seq-1"]
    shuffled = make_dataset({"class": "ConcatDataset", "datasets": [{**p, "seq_ordering": "reverse"} for p in parts]})
    assert shuffled.get_seq_order(1) == [2, 1, 0, 4, 3]
    with pytest.raises(ConfigError, match="empty"):
        make_dataset({"class": "StaticDataset", "data": []})


def test_task12ax_new_sequences_per_epoch_unless_fixed():
    free = Task12AXDataset(20)
    first = [free.get_seq(i)["data"] for i in range(20)]
    assert free.init_epoch(2) is True
    assert any(not np.array_equal(a, free.get_seq(i)["data"]) for i, a in enumerate(first))
    assert free.init_epoch(2) is False  # same epoch: nothing changes
    fixed = Task12AXDataset(20, fixed_random_seed=5)
    kept = [fixed.get_seq(i)["data"] for i in range(20)]
    assert fixed.init_epoch(2) is False
    assert all(np.array_equal(a, fixed.get_seq(i)["data"]) for i, a in enumerate(kept))
    assert Task12AXDataset(20, seed=1).init_epoch(3) is False  # kit's seed: fixed data
    parts = Task12AXDataset(20, partition_epoch=2)
    assert parts.init_epoch(2) is False and parts.init_epoch(3) is True  # one data seed per full epoch


@pytest.mark.parametrize("workers", [0, 1])
def test_pipeline_follows_per_epoch_sequences(workers):
    """Batches of epoch 2 hold epoch 2's sequences (lengths re-read, worker copies renewed)."""
    ds = Task12AXDataset(30, seq_ordering="sorted")
    pipe = Pipeline(ds, batch_size=400, max_seqs=8, num_workers=workers)
    try:
        for epoch in (1, 2, 3):
            pipe.set_epoch(epoch)
            batches = list(pipe)
            ref = Task12AXDataset(30)
            ref.init_epoch(epoch)
            for batch in batches:
                for row, i in enumerate(batch.seq_idx):
                    n = int(batch["data"].lengths[row])
                    assert n == ref.get_seq_length(i)["data"]
                    assert np.array_equal(batch["data"].tensor[row, :n].numpy(), ref.get_seq(i)["data"])
    finally:
        pipe.close()
