"""Worker processes give exactly the batches of num_workers=0."""

import numpy as np
import pytest
import torch

from kit.data import GeneratorDataset, Pipeline
from kit.errors import DataError


def make_seq(seed, index):
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(5, 60))
    return {"data": rng.normal(size=(n, 4)).astype(np.float32), "classes": rng.integers(0, 5, size=n)}


def make_lengths(seed, index):
    n = int(np.random.default_rng([seed, index]).integers(5, 60))
    return {"data": n, "classes": n}


def dataset(**opts):
    return GeneratorDataset(
        make_seq, 200, seed=1, lengths_fn=make_lengths, seq_ordering="laplace:.10", **opts
    )


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.seq_idx == y.seq_idx and x.seq_tags == y.seq_tags and x.batch_idx == y.batch_idx
        assert x.complete_frac == y.complete_frac
        for key in x:
            assert torch.equal(x[key].tensor, y[key].tensor)
            assert torch.equal(x[key].lengths, y[key].lengths)


def test_two_workers_equal_zero_workers_over_epochs():
    ref = Pipeline(dataset(), batch_size=400, max_seqs=10, chunking=30)
    par = Pipeline(dataset(), batch_size=400, max_seqs=10, chunking=30, num_workers=2)
    try:
        for epoch in (1, 2):
            ref.set_epoch(epoch)
            par.set_epoch(epoch)
            a, b = list(ref), list(par)
            assert_same(a, b)
            seqs = sorted({i for batch in b for i in batch.seq_idx})
            assert seqs == list(range(200))  # each seq, no duplicates from workers
            chunks = [(i, t) for batch in b for i, t in zip(batch.seq_idx, batch["data"].lengths.tolist())]
            assert sum(t for _, t in chunks) == sum(make_lengths(1, i)["data"] for i in range(200))
    finally:
        par.close()


def test_resume_with_workers():
    ref = Pipeline(dataset(), batch_size=300)
    ref.set_epoch(3)
    everything = list(ref)
    par = Pipeline(dataset(), batch_size=300, dataloader_opts={"num_workers": 2})
    try:
        assert par.num_workers == 2
        par.set_epoch(3)
        for _ in range(5):
            next(par)
        sd = par.state_dict()
    finally:
        par.close()
    fresh = Pipeline(dataset(), batch_size=300, num_workers=2)
    try:
        fresh.load_state_dict(sd)
        assert_same(list(fresh), everything[5:])
        with pytest.raises(StopIteration):
            next(fresh)
        fresh.set_epoch(3)  # restart the epoch mid-way with the same workers
        assert next(fresh).seq_idx == everything[0].seq_idx
    finally:
        fresh.close()


def test_unpicklable_dataset_is_a_clear_error():
    ds = GeneratorDataset(lambda seed, i: {"data": np.zeros((3, 1))}, 5)
    with pytest.raises(DataError, match="pickled.*num_workers=0"):
        Pipeline(ds, num_workers=2)
    assert len(list(Pipeline(ds, num_workers=0))) == 1  # fine without workers


def seq_with_pid(seed, index):
    import os

    return {"data": np.zeros((3 + index % 4, 1), np.float32), "pid": np.array(os.getpid())}


def test_loading_really_happens_in_workers():
    import os

    pipe = Pipeline(GeneratorDataset(seq_with_pid, 40), batch_size=20, num_workers=2)
    try:
        pids = {int(p) for b in pipe for p in b["pid"].tensor}
    finally:
        pipe.close()
    assert os.getpid() not in pids and len(pids) == 2
