"""Pipeline: batching invariants, filter, chunking, resume, batches() config errors."""

import numpy as np
import pytest
import torch

from kit.config import Config
from kit.data import ArrayDataset, Pipeline, Task12AXDataset, batches
from kit.errors import ConfigError, DataError


def skewed_ds(n=300, seed=0, **opts) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(3.0, 0.8, size=n).astype(int), 1, 400)
    seqs = [
        {"data": np.full((int(t), 3), i, np.float32), "classes": np.full(int(t) // 2 + 1, i % 7, np.int64)}
        for i, t in enumerate(lens)
    ]
    return ArrayDataset(seqs, **opts)


def collect(pipe):
    return [b for b in pipe]


@pytest.mark.parametrize("batch_size,max_seqs", [(200, None), (500, 7), (1000, 3), ({"data": 300}, None)])
def test_batching_invariants(batch_size, max_seqs):
    ds = skewed_ds(seq_ordering="random")
    pipe = Pipeline(ds, batch_size=batch_size, max_seqs=max_seqs)
    pipe.set_epoch(1)
    out = collect(pipe)
    order = ds.get_seq_order(1, random_seed=pipe.random_seed)
    assert [i for b in out for i in b.seq_idx] == order  # every seq once, order kept
    limit = batch_size if isinstance(batch_size, int) else batch_size["data"]
    for k, b in enumerate(out):
        n = b.num_seqs
        assert max_seqs is None or n <= max_seqs
        t = b["data"].tensor.shape[1]
        assert int(b["data"].lengths.max()) == t
        if n > 1:
            assert t * n <= limit  # padding counts
            if isinstance(batch_size, int):
                assert b["classes"].tensor.shape[1] * n <= limit
        else:
            assert t <= limit or n == 1
        # greedy: the next sequence would not have fit
        if k + 1 < len(out) and (max_seqs is None or n < max_seqs):
            nxt = out[k + 1]["data"].lengths[0].item()
            assert (
                max(t, nxt) * (n + 1) > limit
                or not isinstance(batch_size, int)
                or (
                    max(b["classes"].tensor.shape[1], out[k + 1]["classes"].lengths[0].item()) * (n + 1)
                    > limit
                )
            )
        assert b.batch_idx == k and b.epoch == 1
        # RETURNN's complete_frac: the last sequence's position in the epoch's order (+1) / sequences, float32
        done = sum(len(x.seq_idx) for x in out[: k + 1])
        assert b.complete_frac == (1.0 if k + 1 == len(out) else float(np.float32(done / len(order))))


def test_oversize_sequence_is_its_own_batch():
    seqs = [{"data": np.ones((t, 2), np.float32)} for t in (5, 5, 50, 5)]
    out = collect(batches(ArrayDataset(seqs), batch_size=20))
    assert [b.seq_idx for b in out] == [[0, 1], [2], [3]]


def test_padding_and_lengths():
    seqs = [{"data": np.full((t, 2), t, np.float32), "n": np.array(t)} for t in (2, 4, 3)]
    (b,) = collect(batches(ArrayDataset(seqs, seq_tags=["x", "y", "z"]), batch_size=100))
    assert b["data"].lengths.dtype == torch.int32 and b["data"].lengths.tolist() == [2, 4, 3]
    assert b["data"].tensor.shape == (3, 4, 2)
    assert torch.equal(b["data"].tensor[0, 2:], torch.zeros(2, 2))
    assert torch.equal(b["data"].tensor[2, :3], torch.full((3, 2), 3.0))
    assert b["n"].lengths is None and b["n"].tensor.tolist() == [2, 4, 3]
    assert b.seq_tags == ["x", "y", "z"] and b.seq_idx == [0, 1, 2]


def test_length_filter_int_and_per_key():
    ds = skewed_ds()
    lens = [ds.get_seq_length(i) for i in range(len(ds))]
    got = [i for b in batches(ds, min_seq_length=10, max_seq_length=100) for i in b.seq_idx]
    assert got == [i for i, x in enumerate(lens) if all(10 <= v <= 100 for v in x.values())]
    got = [i for b in batches(ds, max_seq_length={"classes": 20}) for i in b.seq_idx]
    assert got == [i for i, x in enumerate(lens) if x["classes"] <= 20]
    with pytest.raises(DataError, match="removed"):
        batches(ds, min_seq_length=10_000)


def test_chunking_counts_contents_and_min_chunk_size():
    data = np.arange(25, dtype=np.float32)[:, None]
    ds = ArrayDataset([{"data": data, "classes": np.arange(25)}])
    chunks = [b for b in batches(ds, chunking=10, batch_size=10)]
    assert [b["data"].lengths.tolist() for b in chunks] == [[10], [10], [5]]
    assert torch.equal(chunks[1]["data"].tensor[0, :, 0], torch.arange(10, 20, dtype=torch.float32))
    assert all(b.seq_tags == ["seq-0"] and b.seq_idx == [0] for b in chunks)  # chunks keep the tag
    assert len(collect(batches(ds, chunking=10, min_chunk_size=6, batch_size=10))) == 2
    overl = [
        b["data"].tensor[0, : b["data"].lengths[0], 0].tolist()
        for b in batches(ds, chunking="10:5", batch_size=10)
    ]
    assert [c[0] for c in overl] == [0, 5, 10, 15, 20] and [len(c) for c in overl] == [10, 10, 10, 10, 5]
    per_key = collect(
        batches(ds, chunking=({"data": 10, "classes": 10}, {"data": 5, "classes": 5}), batch_size=100)
    )
    assert per_key[0]["classes"].lengths.tolist() == [10, 10, 10, 10, 5]


def test_chunking_per_key_subset_leaves_other_keys_whole():
    ds = ArrayDataset([{"data": np.zeros((30, 2), np.float32), "meta": np.arange(4)}])
    (b,) = collect(batches(ds, chunking=({"data": 10}, {"data": 10}), batch_size={"data": 100}))
    assert b["data"].lengths.tolist() == [10, 10, 10]
    assert b["meta"].lengths.tolist() == [4, 4, 4]


def test_eval_chunks_as_returnn_unless_turned_off():
    ds = ArrayDataset([{"data": np.zeros((25, 1), np.float32)}])
    no_chunks = batches(ds, chunking=10, chunking_in_eval=False, train=False)
    assert [b["data"].lengths.tolist() for b in no_chunks] == [[25]]
    (b,) = collect(batches(ds, chunking=10, train=False))  # the config key's default: RETURNN's torch engine
    assert b["data"].lengths.tolist() == [10, 10, 5]
    # a Pipeline built by hand has the config key's default too (no second set of defaults)
    assert [b["data"].lengths.tolist() for b in Pipeline(ds, chunking=10, train=False)] == [[10, 10, 5]]
    pipe = Pipeline(ds, chunking=10, chunking_in_eval=False, train=False)
    assert [b["data"].lengths.tolist() for b in pipe] == [[25]]


def test_partition_epoch_through_pipeline():
    ds = skewed_ds(n=100, partition_epoch=3, seq_ordering="random")
    seen = []
    pipe = Pipeline(ds, batch_size=400)
    for epoch in (1, 2, 3):
        pipe.set_epoch(epoch)
        seen += [i for b in pipe for i in b.seq_idx]
    assert sorted(seen) == list(range(100))


def test_seq_ordering_override_and_seq_indices():
    ds = skewed_ds(n=50)
    lens = [b["data"].lengths.tolist() for b in batches(ds, seq_ordering="sorted", batch_size=10**6)][0]
    assert lens == sorted(lens)
    got = [i for b in batches(ds, seq_indices=[40, 3, 7], num_workers=0) for i in b.seq_idx]
    assert got == [3, 7, 40]


def test_position_resume_fresh_pipeline():
    ds = skewed_ds(seq_ordering="laplace:.20")
    ref = Pipeline(ds, batch_size=300)
    ref.set_epoch(2)
    all_batches = collect(ref)
    pipe = Pipeline(ds, batch_size=300)
    pipe.set_epoch(2)
    for _ in range(4):
        next(pipe)
    sd = pipe.state_dict()
    assert sd["epoch"] == 2 and sd["position"] == 4
    assert all(isinstance(v, (int, str)) for v in sd.values())
    fresh = Pipeline(ds, batch_size=300)
    fresh.load_state_dict(sd)
    rest = collect(fresh)
    assert len(rest) == len(all_batches) - 4
    for a, b in zip(rest, all_batches[4:]):
        assert a.seq_idx == b.seq_idx and a.batch_idx == b.batch_idx
        assert torch.equal(a["data"].tensor, b["data"].tensor)
    with pytest.raises(StopIteration):
        next(fresh)
    with pytest.raises(StopIteration):
        next(fresh)
    # negative control: the position matters
    fresh.load_state_dict({**sd, "position": 3})
    assert next(fresh).seq_idx != rest[0].seq_idx


def test_resume_refuses_changed_plan():
    ds = skewed_ds()
    pipe = Pipeline(ds, batch_size=300)
    pipe.set_epoch(1)
    next(pipe)
    with pytest.raises(DataError, match="batches"):
        Pipeline(ds, batch_size=1000).load_state_dict(pipe.state_dict())


def test_empty_dataset_is_an_error_naming_it():
    with pytest.raises(DataError, match="'devset'.*empty"):
        Pipeline(ArrayDataset([], name="devset")).set_epoch(1)


def test_batches_config_errors():
    ds = Task12AXDataset(10)
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        batches(ds, batch_sise=100)
    with pytest.raises(ConfigError, match="max_seqs"):
        batches(ds, max_seqs=0)
    with pytest.raises(ConfigError, match="seq_ordering"):
        batches(ds, seq_ordering="zigzag")
    with pytest.raises(ConfigError, match="chunking"):
        batches(ds, chunking="a:b")


def test_from_config():
    ds = Task12AXDataset(40)
    cfg = Config(batch_size=300, max_seqs=4, seq_ordering="sorted", chunking=20)
    train = Pipeline.from_config(ds, cfg, train=True)
    b = next(train)
    assert b.num_seqs <= 4 and b["data"].tensor.shape[1] <= 20
    ev = Pipeline.from_config(ds, cfg, train=False)
    assert ev.chunking == 20 and ev.seq_ordering is None  # RETURNN's torch engine chunks eval too
    assert Pipeline.from_config(ds, cfg.copy().update(chunking_in_eval=False), train=False).chunking is None
    assert Pipeline.from_config(ds, cfg, train=True, max_seqs=2).max_seqs == 2


def test_per_key_budgets_each_hold():
    ds = skewed_ds(seq_ordering="random")
    budget = {"data": 400, "classes": 150}
    out = collect(batches(ds, batch_size=budget))
    assert sorted(i for b in out for i in b.seq_idx) == list(range(len(ds)))
    for b in out:
        if b.num_seqs > 1:
            for key, limit in budget.items():
                assert b[key].tensor.shape[1] * b.num_seqs <= limit
    # the classes budget binds: more batches than with the data budget alone
    assert len(out) > len(collect(batches(ds, batch_size={"data": 400})))
