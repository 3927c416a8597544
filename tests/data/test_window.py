"""RETURNN's ``window``: the layout of the windowed features and the values kit refuses."""

from __future__ import annotations

import numpy as np
import pytest

from kit.config import Config
from kit.data import make_dataset
from kit.data.toy import Task12AXDataset
from kit.data.window import sliding_window
from kit.engine.parts import build_datasets
from kit.errors import ConfigError


def test_window_layout_is_neighbours_side_by_side_zero_padded():
    x = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)
    want = np.array(
        [
            [0, 0, 1, 2, 3, 4],  # frame 0: (pad, x0, x1)
            [1, 2, 3, 4, 5, 6],
            [3, 4, 5, 6, 0, 0],  # last frame: (x1, x2, pad)
        ],
        dtype=np.float32,
    )
    got = sliding_window(x, 3)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(sliding_window(x, 5)[0], [0, 0, 0, 0, 1, 2, 3, 4, 5, 6])
    assert sliding_window(x, 1) is x


def test_task12ax_window_from_the_config_and_from_its_dict():
    plain = Task12AXDataset(4)
    from_dict = make_dataset({"class": "Task12AXDataset", "num_seqs": 4, "window": 3})
    from_config = build_datasets(Config({"train": {"class": "Task12AXDataset", "num_seqs": 4}, "window": 3}))["train"]
    x = plain.get_seq(1)["data"]
    for ds in (from_dict, from_config):
        got = ds.get_seq(1)
        assert got["data"].shape == (x.shape[0], 27) and np.array_equal(got["data"][:, 9:18], x)
        assert np.array_equal(got["data"][1:, :9], x[:-1]) and not got["data"][0, :9].any()
        assert np.array_equal(got["classes"], plain.get_seq(1)["classes"])  # targets untouched
        assert ds.extern_data["data"]["shape"] == (None, 27)
    assert plain.extern_data["data"]["shape"] == (None, 9)
    own = build_datasets(Config({"train": {"class": "Task12AXDataset", "num_seqs": 4, "window": 1}, "window": 3}))
    assert own["train"].get_seq(1)["data"].shape == x.shape  # the dict's own window wins


@pytest.mark.parametrize("bad", [2, 0, -3, 1.0, True, "3"])
def test_bad_window_values_are_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match="window"):
        Config({"window": bad})
    with pytest.raises(ConfigError, match="window"):
        Task12AXDataset(4, window=bad)


def test_window_on_sparse_input_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="window"):
        sliding_window(np.array([1, 2, 3]), 3)  # label ids [T]: nothing to put side by side
    seqs = [{"data": np.array([1, 2, 3]), "classes": np.array([0, 1, 0])}]
    with pytest.raises(ConfigError, match="'window' = 3.*ArrayDataset"):
        build_datasets(Config({"train": {"class": "ArrayDataset", "seqs": seqs}, "window": 3}))
    # window 1 (no window) is fine for any class, as in RETURNN
    assert build_datasets(Config({"train": {"class": "ArrayDataset", "seqs": seqs}, "window": 1}))["train"].num_seqs == 1


def test_hdf_window_needs_dense_inputs(tmp_path):
    from kit.data.hdf import HDFDataset, write_hdf

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    write_hdf(tmp_path / "dense.hdf", [{"data": x, "classes": np.array([0, 1, 0, 1])}])
    ds = HDFDataset([str(tmp_path / "dense.hdf")], window=3)
    assert np.array_equal(ds.get_seq(0)["data"], sliding_window(x, 3)) and ds.extern_data["data"]["shape"] == (None, 9)
    write_hdf(tmp_path / "sparse.hdf", [{"data": np.array([1, 2, 3]), "classes": np.array([0, 1, 0])}])
    with pytest.raises(ConfigError, match="window=3 needs dense"):
        HDFDataset([str(tmp_path / "sparse.hdf")], window=3)
    assert HDFDataset([str(tmp_path / "sparse.hdf")]).get_seq(0)["data"].shape == (3,)  # without a window: fine
