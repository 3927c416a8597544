"""Sequence orders equal real RETURNN's (PyPI ``returnn``), for every seq_ordering, seed and epoch.

The same small cases run in-process under RETURNN (``init_dataset`` + ``init_seq_order``) and
under kit (``Dataset.get_seq_order``). Skips when RETURNN is not installed (CI installs it).
"""

from __future__ import annotations

import numpy as np
import pytest

rdatasets = pytest.importorskip("returnn.datasets", reason="parity tests need RETURNN (pip install returnn)")

from kit.data import ArrayDataset  # noqa: E402

ORDERINGS = [
    "default",
    "reverse",
    "sorted",
    "sorted_reverse",
    "random",
    "random:3",
    "random_sample",
    "random_sample:2",
    "laplace",
    "laplace:4",
    "laplace:.10",
    "laplace:.10:2",
    "laplace:.50",  # fewer than 2*S seqs: RETURNN makes 2 bins
    "sort_bin_shuffle",
    "sort_bin_shuffle:5",
    "sort_bin_shuffle:.10",
    "sort_bin_shuffle_x2:.10",
    "sort_bin_shuffle:.10:3",
    "default_every_n:4",
]


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 40, size=n)  # many ties: the tie order must match too


def _returnn_order(lens: np.ndarray, epoch: int, **opts) -> list[int]:
    data = [{"data": np.zeros((int(t), 2), np.float32)} for t in lens]
    opts.setdefault("random_seed_offset", 0)  # independent of any global RETURNN config
    ds = rdatasets.init_dataset({"class": "StaticDataset", "data": data, **opts})
    ds.init_seq_order(epoch=epoch)
    return [int(i) for i in ds.get_current_seq_order()]


def _kit_order(lens: np.ndarray, epoch: int, **opts) -> list[int]:
    ds = ArrayDataset([{"data": np.zeros((int(t), 2), np.float32)} for t in lens], **opts)
    return ds.get_seq_order(epoch, random_seed=1234)  # the config's random_seed plays no part


@pytest.mark.parametrize("method", ORDERINGS)
def test_orders_equal_returnn(method):
    lens = _lengths(83)
    for epoch in (1, 2, 5):
        assert _kit_order(lens, epoch, seq_ordering=method) == _returnn_order(lens, epoch, seq_ordering=method)


@pytest.mark.parametrize("method", ["random", "laplace:.8", "sort_bin_shuffle_x2:.8", "sorted", "random_sample"])
@pytest.mark.parametrize("parts", [2, 3])
def test_partition_epoch_equals_returnn(method, parts):
    lens = _lengths(61, seed=1)
    for epoch in range(1, 2 * parts + 2):
        opts = {"seq_ordering": method, "partition_epoch": parts}
        assert _kit_order(lens, epoch, **opts) == _returnn_order(lens, epoch, **opts), epoch


@pytest.mark.parametrize("opts", [{"fixed_random_seed": 7}, {"random_seed_offset": 16127}])
def test_seed_options_equal_returnn(opts):
    lens = _lengths(40, seed=2)
    for method in ("random", "laplace:.5", "sort_bin_shuffle:.5"):
        for epoch in (1, 3):
            kit_order = _kit_order(lens, epoch, seq_ordering=method, **opts)
            assert kit_order == _returnn_order(lens, epoch, seq_ordering=method, **opts)


def test_negative_control_other_seed_differs():
    lens = _lengths(50)
    assert _kit_order(lens, 1, seq_ordering="random") != _returnn_order(lens, 2, seq_ordering="random")
    kit_other = _kit_order(lens, 1, seq_ordering="laplace:.10", random_seed_offset=1)
    assert kit_other != _returnn_order(lens, 1, seq_ordering="laplace:.10")
