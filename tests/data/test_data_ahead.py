"""Loading batches ahead (kit.data.ahead) gives exactly the batches loaded one by one."""

import numpy as np
import pytest
import torch

from kit.data import ArrayDataset, Pipeline, batches
from kit.data import ahead as ahead_mod
from kit.data.block import BlockMemory
from kit.data.collate import BatchLoader
from kit.data.packed import PackedKey
from kit.errors import DataError

SPEC = {"data": {"shape": (None, 3)}, "classes": {"shape": (None,), "sparse_dim": 5}}


class PerSeq(ArrayDataset):
    """The same data without packed storage (loaded through get_seq: never ahead)."""

    def get_seq(self, idx):
        return super().get_seq(idx)


class Windows(ArrayDataset):
    """Overlapping windows of one array, packed as such (rows that are not back to back)."""

    def __init__(self, n=300, length=4, step=2):
        rng = np.random.default_rng(1)
        self.base, self.starts = rng.normal(size=(step * n + length, 3)), np.arange(n, dtype=np.int64) * step
        labels = rng.integers(0, 5, len(self.base)).astype(np.int32)
        self.labels, self.length = labels, length
        super().__init__([{"data": self.base[s : s + length], "classes": labels[s : s + length]} for s in self.starts])

    def packed(self):
        lengths = np.full(len(self.starts), self.length, dtype=np.int64)
        return {"data": PackedKey(self.base, self.starts, lengths), "classes": PackedKey(self.labels, self.starts, lengths)}


class SharedLayout(ArrayDataset):
    """Two keys packed with the very same starts and lengths arrays, of varying lengths (padding)."""

    def __init__(self, n=300):
        rng = np.random.default_rng(2)
        self.lengths = rng.integers(1, 7, n).astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        total = int(self.lengths.sum())
        self.base, self.labels = rng.normal(size=(total, 3)), rng.integers(0, 5, total).astype(np.int32)
        super().__init__([{"data": self.base[s : s + t], "classes": self.labels[s : s + t]}
                          for s, t in zip(self.starts, self.lengths)])

    def packed(self):
        return {"data": PackedKey(self.base, self.starts, self.lengths),
                "classes": PackedKey(self.labels, self.starts, self.lengths)}


def seqs(n=300, seed=0, max_len=6, fixed=None):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = fixed or int(rng.integers(1, max_len + 1))
        out.append({
            "data": rng.normal(size=(t, 3)).astype(np.float64),
            "classes": rng.integers(0, 5, t).astype(np.int32),
            "speaker": np.array(rng.integers(0, 4)),  # 0-dim, not declared
            "frames": rng.normal(size=(t, 2)),  # not declared, has time
        })
    return out


def same(x, y):
    assert (x.seq_idx, x.seq_tags, x.epoch, x.batch_idx, list(x)) == (y.seq_idx, y.seq_tags, y.epoch, y.batch_idx, list(y))
    assert x.complete_frac == y.complete_frac
    for key in x:
        fx, fy = x[key], y[key]
        assert fx.tensor.dtype == fy.tensor.dtype and fx.tensor.shape == fy.tensor.shape, key
        assert torch.equal(fx.tensor, fy.tensor) and fx.sparse_dim == fy.sparse_dim, key
        assert (fx.lengths is None) == (fy.lengths is None)
        if fx.lengths is not None:
            assert fx.lengths.dtype == torch.int32 and torch.equal(fx.lengths, fy.lengths)


def one_by_one(monkeypatch, make):
    """The reference: each batch gathered on its own turn, by itself."""
    with monkeypatch.context() as m:
        m.setattr(ahead_mod, "MAX_BATCHES", 1)  # nothing loaded ahead
        m.setattr(BatchLoader, "load_block", lambda self, *a: None)  # nor gathered as a block
        return make()


def epochs(pipe, n=2):
    out = []
    for epoch in range(1, n + 1):
        pipe.set_epoch(epoch)
        out += list(pipe)
    return out


@pytest.fixture
def loads(monkeypatch):
    """How many batches the loader has loaded so far."""
    count = [0]
    plain, block = BatchLoader.load_planned, BatchLoader.load_block

    def counting(self, batch):
        count[0] += 1
        return plain(self, batch)

    def counting_block(self, *args):
        out = block(self, *args)
        count[0] += len(out or ())
        return out

    monkeypatch.setattr(BatchLoader, "load_planned", counting)
    monkeypatch.setattr(BatchLoader, "load_block", counting_block)
    return count


@pytest.mark.parametrize("extern_data", [SPEC, None])
@pytest.mark.parametrize(
    "opts",
    [
        {"batch_size": 20, "max_seqs": 3, "seq_ordering": "random"},  # > 64 batches: several loads per epoch
        {"batch_size": 30, "chunking": (3, 2)},
        {"batch_size": 50, "chunking": ({"data": 4, "classes": 4, "frames": 4}, 4), "seq_ordering": "laplace:.10"},
        {"batch_size": 10**6, "max_seqs": 64},
    ],
)
@pytest.mark.parametrize("fixed", [None, 1, 4])  # 1, 4: whole rows of one length
def test_ahead_equals_one_by_one_across_epochs(monkeypatch, extern_data, opts, fixed):
    ds = ArrayDataset(seqs(fixed=fixed))
    assert ds.packed() is not None
    make = lambda: epochs(Pipeline(ds, extern_data=extern_data, **opts))  # noqa: E731
    a, b = make(), one_by_one(monkeypatch, make)
    assert len(a) == len(b) > 2
    for x, y in zip(a, b):
        same(x, y)
    plain = BatchLoader(ds, Pipeline(ds, extern_data=extern_data).extern_data)  # the loader on its own
    pipe = Pipeline(ds, extern_data=extern_data, **opts)
    for x, entries in zip(pipe, pipe.plan()):
        assert torch.equal(x["data"].tensor, plain.load(entries)["data"].tensor)


@pytest.mark.parametrize("fixed", [None, 1])
def test_batches_are_loaded_ahead_within_limits(monkeypatch, loads, fixed):
    pipe = Pipeline(ArrayDataset(seqs(fixed=fixed)), extern_data=SPEC, batch_size=10**6, max_seqs=2, prefetch=0)
    n = len(pipe)
    next(pipe)
    assert loads[0] == ahead_mod.MAX_BATCHES  # this one and the next 63
    for _ in range(ahead_mod.MAX_BATCHES - 1):
        next(pipe)
    assert loads[0] == ahead_mod.MAX_BATCHES
    next(pipe)
    assert loads[0] == 2 * ahead_mod.MAX_BATCHES
    assert sum(1 for _ in pipe) == n - ahead_mod.MAX_BATCHES - 1
    assert loads[0] == n  # never past the epoch's end, each batch loaded once
    monkeypatch.setattr(ahead_mod, "MAX_BYTES", 1)  # a byte budget stops it too
    pipe.set_epoch(2)
    next(pipe)
    assert loads[0] == n + 1  # over the budget with the batch asked for: none ahead


@pytest.mark.parametrize("extern_data", [SPEC, None])
def test_overlapping_windows_and_whole_rows(monkeypatch, extern_data):
    for ds in (Windows(), ArrayDataset(seqs(fixed=3))):
        make = lambda ds=ds: epochs(  # noqa: E731
            Pipeline(ds, extern_data=extern_data, batch_size=10**6, max_seqs=3, seq_ordering="random")
        )
        a, b = make(), one_by_one(monkeypatch, make)
        assert len(a) == len(b) == 200
        for x, y in zip(a, b):
            same(x, y)
        a[1]["data"].tensor.fill_(7)  # a batch's tensors are its own
        same(a[2], b[2])


def test_no_loading_ahead_without_packed_storage_or_with_workers(loads):
    next(Pipeline(PerSeq(seqs(50)), extern_data=SPEC, batch_size=10**6, max_seqs=2))
    assert loads[0] == 1  # first sight of per-sequence data: loaded on its turn only
    ds = ArrayDataset(seqs(50))
    workers = Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=2, num_workers=1)
    try:
        pipe = Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=2)
        for x, y in zip(workers, pipe):
            same(x, y)
    finally:
        workers.close()


@pytest.mark.parametrize("fixed", [None, 2])
def test_bad_label_raises_at_its_batch_naming_its_sequence(monkeypatch, fixed):
    data = seqs(200, fixed=fixed)
    data[150]["classes"][0] = 7
    ds = ArrayDataset(data, seq_tags=[f"utt{i}" for i in range(200)])
    pipe = batches(ds, extern_data=SPEC, batch_size=10**6, max_seqs=2)
    for b in range(75):  # batches before it come, loaded ahead around the bad one
        assert next(pipe).seq_idx == [2 * b, 2 * b + 1]
    with pytest.raises(DataError) as err:
        next(pipe)
    ref = one_by_one(monkeypatch, lambda: batches(ds, extern_data=SPEC, batch_size=10**6, max_seqs=2))
    with pytest.raises(DataError) as ref_err:
        list(ref)
    assert str(err.value) == str(ref_err.value)
    assert "'classes' in sequence 'utt150'" in str(err.value) and "label 7" in str(err.value)


def test_resume_mid_epoch_and_set_epoch_drop_what_was_loaded_ahead(monkeypatch):
    ds = ArrayDataset(seqs())
    pipe = Pipeline(ds, extern_data=SPEC, batch_size=20, max_seqs=3, seq_ordering="random")
    pipe.set_epoch(1)
    for _ in range(10):
        next(pipe)
    state = pipe.state_dict()
    pipe.set_epoch(2)  # loaded ahead in epoch 1: not given out in epoch 2
    second = list(pipe)
    resumed = Pipeline(ds, extern_data=SPEC, batch_size=20, max_seqs=3, seq_ordering="random")
    resumed.load_state_dict(state)
    rest = list(resumed)
    ref = one_by_one(monkeypatch, lambda: epochs(
        Pipeline(ds, extern_data=SPEC, batch_size=20, max_seqs=3, seq_ordering="random")))
    n1 = sum(1 for x in ref if x.epoch == 1)
    assert len(rest) == n1 - 10 and len(second) == len(ref) - n1
    for x, y in zip(rest + second, ref[10:n1] + ref[n1:]):
        same(x, y)
    pipe.load_state_dict(state)  # back to epoch 1, batch 10, after loading ahead in epoch 2
    same(next(pipe), ref[10])
    pipe.set_epoch(1)
    for _ in range(5):
        next(pipe)  # batches 5.. of epoch 1 are loaded ahead
    pipe.load_state_dict({"epoch": 2, "position": 5, "num_batches": len(pipe)})
    same(next(pipe), ref[n1 + 5])  # epoch 2's, not epoch 1's batch 5


def test_masks_prepared_ahead_are_the_masks_each_call_its_own():
    pipe = Pipeline(ArrayDataset(seqs()), extern_data=SPEC, batch_size=10**6, max_seqs=3)
    first, second = next(pipe), next(pipe)  # the second was loaded ahead, its masks built then
    for b in (first, second):
        f = b["classes"]
        lengths = f.lengths.numpy()
        expected = np.arange(f.tensor.shape[1])[None, :] < lengths[:, None]
        m1 = f.mask()
        assert m1.dtype == torch.bool and np.array_equal(m1.numpy(), expected)
        m1.fill_(False)  # the caller's to change: the next call builds a new one
        m2 = f.mask()
        assert m2 is not m1 and np.array_equal(m2.numpy(), expected)
    static = second["speaker"]
    static.prepare_mask()  # no time axis: nothing to prepare
    with pytest.raises(ValueError, match="no time axis"):
        static.mask()
    assert repr(second["data"]).startswith("Field((3, ") and "lengths=" in repr(second["data"])


@pytest.fixture
def blocks(monkeypatch):
    """How many batches each block gather gave (None: it did not apply)."""
    given = []
    block = BatchLoader.load_block

    def recording(self, *args):
        out = block(self, *args)
        given.append(None if out is None else len(out))
        return out

    monkeypatch.setattr(BatchLoader, "load_block", recording)
    return given


@pytest.mark.parametrize(
    "make_ds, spec",
    [
        (lambda: ArrayDataset(seqs(max_len=9)), SPEC),  # padded rows of varying lengths
        (lambda: ArrayDataset(seqs(fixed=1)), SPEC),  # whole rows of one frame
        (lambda: ArrayDataset(seqs(fixed=4)), None),
        (lambda: Windows(), SPEC),  # one length, rows not back to back
        (lambda: SharedLayout(), SPEC),  # keys of one layout: each still gets its own mask
        (lambda: ArrayDataset([{"data": np.full((t, 2, 2), t, np.float64), "classes": np.arange(t) % 3}
                               for t in [1, 3, 2, 5, 4] * 40]),
         {"data": {"shape": (None, 2, 2), "dtype": "float32"}, "classes": {"shape": (None,), "sparse_dim": 3}}),
    ],
)
@pytest.mark.parametrize("opts", [
    {"batch_size": 10**6, "max_seqs": 3},
    {"batch_size": 12, "seq_ordering": "random", "online_shuffle_batches": 7},  # batches not in entry order
])
def test_block_gather_equals_one_by_one(monkeypatch, blocks, make_ds, spec, opts):
    make = lambda: epochs(Pipeline(make_ds(), extern_data=spec, **opts))  # noqa: E731
    ref = one_by_one(monkeypatch, make)
    got = make()
    assert [n for n in blocks if n is not None] and None not in blocks  # every load after the first one: a block
    assert len(got) == len(ref) > 2
    got[1]["classes"].mask().fill_(True)  # a prepared mask is the caller's: no other key's changes with it
    assert torch.equal(got[1]["data"].mask(), ref[1]["data"].mask())
    got, ref = got[2:], ref[2:]
    for x, y in zip(got, ref):
        same(x, y)
        for key in x:
            if x[key].lengths is not None:
                assert torch.equal(x[key].mask(), y[key].mask()), key
    got[1]["data"].tensor.fill_(7)  # views of one block, but each batch's own
    got[1]["classes"].mask().fill_(True)
    same(got[0], ref[0])
    same(got[2], ref[2])
    assert torch.equal(got[2]["classes"].mask(), ref[2]["classes"].mask())


def test_block_gather_keeps_the_byte_budget(monkeypatch, blocks):
    ds = ArrayDataset(seqs(fixed=2))  # every batch of 3 sequences has the same size
    per_batch = ahead_mod.batch_bytes(next(Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=3)))
    blocks.clear()
    for budget, loaded in ((5 * per_batch + 1, 6), (5 * per_batch, 5), (1, 1)):
        monkeypatch.setattr(ahead_mod, "MAX_BYTES", budget)
        next(Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=3))
        assert blocks[-1] == loaded  # a batch is loaded while the bytes before it stay under the budget


def test_block_gather_falls_back_where_it_does_not_apply(monkeypatch, blocks):
    long_rows = ArrayDataset(seqs(max_len=60, fixed=None))  # rows above LONG_ROWS frames on average
    chunked = ArrayDataset(seqs())
    for ds, opts in ((long_rows, {}), (chunked, {"chunking": (3, 2)})):
        blocks.clear()
        make = lambda ds=ds, opts=opts: epochs(  # noqa: E731
            Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=3, **opts))
        got, ref = make(), one_by_one(monkeypatch, make)
        assert blocks and set(blocks) == {None}
        for x, y in zip(got, ref):
            same(x, y)


def test_block_buffers_are_used_again_only_once_no_batch_holds_them(monkeypatch):
    ds = ArrayDataset(seqs(n=600, max_len=9))
    monkeypatch.setattr(ahead_mod, "MAX_BATCHES", 8)
    pipe = Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=3, seq_ordering="random")
    ref = one_by_one(monkeypatch, lambda: list(Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=3,
                                                         seq_ordering="random")))
    kept = {}
    for i, batch in enumerate(pipe):  # batches of 25 blocks go by; every fifth one is kept
        if i % 5 == 0:
            kept[i] = batch
    assert len(kept) > 10
    for i, batch in kept.items():  # what later blocks were carved into never overwrote a kept batch
        same(batch, ref[i])
        assert torch.equal(batch["classes"].mask(), ref[i]["classes"].mask())
    memory = BlockMemory(keep=2)
    carver = memory.carver()  # the first block: no buffer yet (its size is not known)
    a = carver.array((4, 3), np.dtype(np.float32), zero=True)
    memory.used(carver)
    first = memory.carver()
    b = first.array((4, 3), np.dtype(np.float32), zero=False)
    assert b.ctypes.data % 64 == 0 and b.base is not None
    b[:] = 5
    memory.used(first)
    held = torch.from_numpy(b)  # a tensor over it: its buffer stays busy
    del b
    second = memory.carver().array((4, 3), np.dtype(np.float32), zero=True)
    assert not np.shares_memory(second, held.numpy()) and (held == 5).all() and not second.any()
    del held, second
    third = memory.carver().array((4, 3), np.dtype(np.float32), zero=True)  # both buffers free again
    assert not third.any() and a.shape == (4, 3)


def test_block_batches_float_tensors_start_16_byte_aligned(blocks):
    """A batch's float tensor starts where malloc's, numpy's (and so RETURNN's) would: on a 16-byte
    boundary. MKL's matrix products round differently for inputs that do not (on AVX-512 CPUs), so a
    view wherever the previous batch ended made kit's losses differ from RETURNN's in the last bit."""
    ds = ArrayDataset([{"data": np.full((t, 9), t, np.float32), "classes": np.arange(t) % 3}
                       for t in [4, 7, 5, 11, 6] * 40])  # 36-byte frames: most batches end off a boundary
    spec = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 3}}
    got = list(Pipeline(ds, extern_data=spec, batch_size=40, max_seqs=4))
    assert [n for n in blocks if n is not None]  # gathered as blocks
    assert len(got) > 10 and all(b["data"].tensor.data_ptr() % 16 == 0 for b in got)
    ends = [b["data"].tensor.numel() * 4 for b in got]
    assert any(e % 16 for e in ends)  # batches whose views alone would have started off a boundary
