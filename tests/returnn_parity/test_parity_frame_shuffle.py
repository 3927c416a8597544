"""``shuffle_frames_of_nseqs`` against the installed RETURNN's HDFDataset: the same frames per sequence.

RETURNN 1.20261022 shuffles only with its cache on and large enough for all the data, with a
sequence count that n divides, and with no target keys (see the key's doc in kit/config/keys.py);
these tests compare kit with it there, bitwise, and pin down where RETURNN fails or differs by design.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("h5py", reason="HDF parity needs h5py")
rdatasets = pytest.importorskip("returnn.datasets", reason="parity tests need RETURNN (pip install returnn)")

from kit.config import Config  # noqa: E402
from kit.data.hdf import HDFDataset, write_hdf  # noqa: E402
from kit.data.pipeline import Pipeline  # noqa: E402
from kit.engine.parts import build_datasets  # noqa: E402
from kit.errors import ConfigError  # noqa: E402

LENS = [3, 5, 2, 4, 6, 3, 7, 1, 4, 5, 2, 6]  # 12 sequences: 2, 3 and 4 divide it


def _file(tmp_path) -> str:
    rng = np.random.RandomState(7)
    path = str(tmp_path / "frames.hdf")
    write_hdf(path, [{"data": rng.uniform(-1, 1, (n, 3)).astype("float32")} for n in LENS])
    return path


def _returnn(path: str, epochs, **opts) -> list[list[np.ndarray]]:
    """RETURNN's frames per sorted sequence index, per epoch (after its preload thread has shuffled them)."""
    from returnn.log import log

    log.initialize(verbosity=[0])
    ds = rdatasets.init_dataset({"class": "HDFDataset", "files": [path], "cache_byte_size": 10**8, **opts})
    out = []
    for epoch in epochs:
        ds.init_seq_order(epoch=epoch)
        for t in threading.enumerate():  # its preload thread marks sequences loaded before it shuffles them
            if "_preload_seqs" in t.name:
                t.join(timeout=30)
        ds.load_seqs(0, ds.num_seqs)
        out.append([ds.get_data(i, "data").copy() for i in range(ds.num_seqs)])
    return out


def _kit(path: str, epochs, **opts) -> list[list[np.ndarray]]:
    p = Pipeline(HDFDataset(path, **opts), batch_size=10_000, max_seqs=1)
    out = []
    for epoch in epochs:
        p.set_epoch(epoch)
        out.append([b["data"].tensor[0, : int(b["data"].lengths[0])].numpy() for b in p])
    p.close()
    return out


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("n", "opts"), [(2, {}), (3, {"seq_ordering": "random"}), (4, {"seq_ordering": "sorted"}),
                                         (3, {"seq_ordering": "laplace:.4", "window": 3})])
def test_frames_equal_returnn(tmp_path, n, opts):
    path = _file(tmp_path)
    want = _returnn(path, [1], shuffle_frames_of_nseqs=n, **opts)[0]
    got = _kit(path, [1], shuffle_frames_of_nseqs=n, **opts)[0]
    assert _equal(got, want)  # bitwise
    assert not _equal(_kit(path, [1], **opts)[0], want)  # negative control: unshuffled frames differ


def test_later_epochs_of_a_fixed_order_equal_returnn_and_random_ones_are_kits_own(tmp_path):
    path = _file(tmp_path)
    want = _returnn(path, [1, 2], shuffle_frames_of_nseqs=3)
    assert all(_equal(g, w) for g, w in zip(_kit(path, [1, 2], shuffle_frames_of_nseqs=3), want))
    # a new order: RETURNN's full cache keeps the frames its first epoch shuffled (by that epoch's groups);
    # kit shuffles every epoch by its own groups, so a resumed run sees what an unbroken one saw
    _, r2 = _returnn(path, [1, 2], shuffle_frames_of_nseqs=3, seq_ordering="random")
    k2 = _kit(path, [2], shuffle_frames_of_nseqs=3, seq_ordering="random")[0]
    assert _equal(_returnn(path, [2], shuffle_frames_of_nseqs=3, seq_ordering="random")[0], k2)  # fresh: equal
    assert not _equal(r2, k2)


def test_returnn_without_its_cache_fails(tmp_path):
    ds = rdatasets.init_dataset({"class": "HDFDataset", "files": [_file(tmp_path)], "shuffle_frames_of_nseqs": 2})
    ds.init_seq_order(epoch=1)
    with pytest.raises(AssertionError):
        ds.load_seqs(0, 1)


def test_the_config_key_reaches_returnn_classes_through_the_adapter():
    spec = {"class": "DummyDataset", "input_dim": 2, "output_dim": 3, "num_seqs": 4, "seq_len": 5}
    with pytest.raises(ConfigError, match="'DummyDataset'.*shuffle_frames_of_nseqs"):  # RETURNN's GeneratingDataset asserts 0
        build_datasets(Config({"train": spec, "shuffle_frames_of_nseqs": 2}))
    built = build_datasets(Config({"train": spec, "dev": spec}))  # negative control: without the key
    assert built["train"].returnn.shuffle_frames_of_nseqs == 0
    dev = build_datasets(Config({"train": {**spec, "shuffle_frames_of_nseqs": 0}, "dev": spec,
                                 "shuffle_frames_of_nseqs": 2}))["dev"]
    assert dev.returnn.shuffle_frames_of_nseqs == 0  # RETURNN's eval default
