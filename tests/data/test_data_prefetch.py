"""The prefetch thread (``data_prefetch``): same batches, same order, same resume, same RNG draws; closed."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from kit.data import ArrayDataset, HDFDataset, Pipeline
from kit.data import hdf as hdf_mod
from kit.data.hdf import write_hdf

SPEC = {"data": {"shape": (None, 3)}, "classes": {"shape": (None,), "sparse_dim": 5}}


def seqs(n: int = 60, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"data": rng.standard_normal((t, 3), dtype=np.float32), "classes": rng.integers(0, 5, t).astype(np.int32)}
        for t in rng.integers(1, 30, size=n)
    ]


@pytest.fixture
def hdf_files(tmp_path):
    data = seqs(60)
    paths = []
    for f in range(6):
        paths.append(str(tmp_path / f"d{f}.hdf"))
        write_hdf(paths[-1], data[10 * f : 10 * (f + 1)])
    return paths


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kit-data-prefetch" and t.is_alive()]


def collect(pipe: Pipeline) -> list[tuple[list[int], list[torch.Tensor]]]:
    return [(b.seq_idx, [f.tensor for f in b.fields.values()] + [b["data"].lengths]) for b in pipe]


def same(a, b) -> None:
    assert [x[0] for x in a] == [y[0] for y in b]
    for (_, ta), (_, tb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ta, tb))


def make(ds, **opts) -> Pipeline:
    return Pipeline(ds, extern_data=SPEC, batch_size=60, max_seqs=4, seq_ordering="laplace:.10", **opts)


@pytest.mark.parametrize("kind", ["hdf", "array"])
def test_same_batches_in_the_same_order_with_and_without_prefetch(hdf_files, kind):
    ds = lambda: HDFDataset(hdf_files) if kind == "hdf" else ArrayDataset(seqs(60))  # noqa: E731
    sync, ahead = make(ds(), prefetch=0), make(ds())
    # the default prefetches data read from files (0 turns it off); in-memory data loads on the training thread
    assert not sync.prefetching and ahead.prefetching == (kind == "hdf")
    for epoch in (1, 2):
        sync.set_epoch(epoch)
        ahead.set_epoch(epoch)
        ref, got = collect(sync), collect(ahead)
        same(ref, got)
        assert sorted(i for idx, _ in got for i in idx) == list(range(60))  # each sequence once
    ahead.close()
    assert not prefetch_threads()


def test_position_counts_batches_taken_and_resume_is_exact(hdf_files):
    ref = make(HDFDataset(hdf_files), prefetch=0)
    ref.set_epoch(2)
    expected = collect(ref)
    pipe = make(HDFDataset(hdf_files), prefetch=3)
    pipe.set_epoch(2)
    taken = [next(pipe) for _ in range(4)]
    assert [b.seq_idx for b in taken] == [x[0] for x in expected[:4]]
    assert pipe.state_dict()["position"] == 4  # not the batches the thread loaded ahead
    state = pipe.state_dict()
    pipe.close()
    resumed = make(HDFDataset(hdf_files))
    resumed.load_state_dict(state)
    same(collect(resumed), expected[4:])
    # a restore into the same, running pipeline drops what it had loaded ahead
    pipe = make(HDFDataset(hdf_files))
    pipe.set_epoch(2)
    for _ in range(6):
        next(pipe)
    pipe.load_state_dict(state)
    same(collect(pipe), expected[4:])


def test_thread_closed_on_close_on_garbage_collection_and_after_an_exception(hdf_files):
    pipe = make(HDFDataset(hdf_files))
    next(pipe)
    assert len(prefetch_threads()) == 1
    pipe.close()
    assert not prefetch_threads()

    def train_until_error() -> None:
        pipe = make(HDFDataset(hdf_files))
        for i, _ in enumerate(pipe):
            if i == 2:
                raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError):
        train_until_error()
    gc.collect()
    assert not prefetch_threads()  # the pipeline went away with the frame: its thread with it


class DrawingDataset(ArrayDataset):
    """User code: draws augmentation noise from the global RNGs."""

    def get_seq(self, idx):
        seq = dict(super().get_seq(idx))
        seq["data"] = seq["data"] + np.float32(np.random.random()) + np.float32(torch.rand(()).item())
        return seq


def test_user_dataset_loads_on_the_training_thread_with_the_same_draws():
    def run(**opts):
        np.random.seed(1)
        torch.manual_seed(1)
        pipe = make(DrawingDataset(seqs(40)), **opts)
        out, draws = [], []
        for b in pipe:  # the training thread draws too (dropout, say), between batches
            out.append(b["data"].tensor)
            draws.append((np.random.random(), torch.rand(()).item()))
        return pipe, out, draws

    pipe, out, draws = run()
    assert not pipe.prefetching  # user code: never on a thread
    _, ref_out, ref_draws = run(prefetch=0)
    assert draws == ref_draws
    assert all(torch.equal(a, b) for a, b in zip(out, ref_out))


def test_own_dataset_on_the_thread_leaves_the_training_threads_rng_alone(hdf_files):
    torch.manual_seed(3)
    np.random.seed(3)
    expected = [(torch.rand(()).item(), np.random.random()) for _ in range(8)]
    torch.manual_seed(3)
    np.random.seed(3)
    pipe = make(HDFDataset(hdf_files))
    got = [(torch.rand(()).item(), np.random.random()) for _ in pipe][:8]
    assert pipe.prefetching and got == expected


def test_open_hdf_files_stay_bounded_and_reopen(hdf_files, monkeypatch):
    monkeypatch.setattr(hdf_mod, "MAX_OPEN_FILES", 2)
    ds = HDFDataset(hdf_files)
    data = seqs(60)
    for i in [*range(60), *reversed(range(60))]:  # every file, twice, in two directions
        assert np.array_equal(ds.get_seq(i)["data"], data[i]["data"])
        assert ds.open_files <= 2
    monkeypatch.setattr(hdf_mod, "MAX_OPEN_FILES", 100)
    for i in range(60):
        ds.get_seq(i)
    assert ds.open_files == 6  # negative control: without the bound every file stays open


def test_session_close_stops_the_thread(tmp_path):
    import kit
    from kit.data import Task12AXDataset
    from kit.data.hdf import write_hdf
    from tests.helpers.models import tiny_config

    toy = Task12AXDataset(400, seed=1)  # many batches: the thread is still loading after 3 steps
    write_hdf(str(tmp_path / "train.hdf"), [toy.get_seq(i) for i in range(400)], tags=[f"t{i}" for i in range(400)])
    session = kit.Session(**tiny_config(str(tmp_path / "model"), train=HDFDataset([str(tmp_path / "train.hdf")])))
    try:
        session.train_steps(3)
        assert len(prefetch_threads()) == 1  # HDF files, read by kit's own code: the next batches load meanwhile
    finally:
        session.close()
    assert not prefetch_threads()
