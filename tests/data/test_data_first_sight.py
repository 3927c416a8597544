"""The vectorised epoch plan and the per-sequence checks made once: the same batches as checking every time."""

import pickle

import numpy as np
import pytest
import torch

from kit.data import ArrayDataset, Dataset, Pipeline, TorchDataset, batches
from kit.data.batching import chunk_arrays, entries_of, plan_batches
from kit.data.collate import BatchLoader, collate
from kit.errors import DataError

SPEC = {"data": {"shape": (None, 3)}, "classes": {"shape": (None,), "sparse_dim": 5}}


def seqs(n=40, seed=0, max_len=9, dtype=np.int64):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, max_len + 1))
        out.append({"data": rng.normal(size=(t, 3)).astype(np.float32), "classes": rng.integers(0, 5, t).astype(dtype)})
    return out


class Items(torch.utils.data.Dataset):
    def __init__(self, data):
        self.items = [{k: torch.from_numpy(v) for k, v in s.items()} for s in data]
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.reads += 1
        return self.items[i]


def full_check(ds, batch, extern_data=SPEC):
    """The batch as collate builds it with every check on every sequence (nothing noted)."""
    items = [ds.get_seq(i) for i in batch.seq_idx]
    return collate(items, [ds.get_seq_tag(i) for i in batch.seq_idx], Pipeline(ds, extern_data=extern_data).extern_data)


def assert_fields_equal(got, want):
    assert list(got) == list(want)
    for key in want:
        a, b = got[key], want[key]
        assert a.tensor.dtype == b.tensor.dtype and torch.equal(a.tensor, b.tensor), key
        assert (a.lengths is None) == (b.lengths is None)
        if b.lengths is not None:
            assert a.lengths.dtype == torch.int32 and torch.equal(a.lengths, b.lengths), key


# ---- the plan -------------------------------------------------------------------------------


def chunks_by_loop(order, lengths, sizes, steps, mins):
    """RETURNN's chunking written as the plain loop: the reference for the numpy version."""
    out = []
    for i in order:
        per_key = []
        for k in sizes:
            n = int(lengths[k][i])
            per_key.append([(k, s, min(s + sizes[k], n)) for s in range(0, n, steps[k]) if min(s + sizes[k], n) - s >= mins.get(k, 0)])
        out.extend((int(i), spans) for spans in zip(*per_key))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_numpy_chunking_equals_the_loop(seed):
    rng = np.random.default_rng(seed)
    n = 50
    lens = rng.integers(0, 40, n)
    lengths = {"data": lens, "frames": lens, "classes": lens // 2}
    order = rng.permutation(n)
    checked = 0
    for size, step, lo in [(10, 10, 0), (10, 5, 3), (7, 3, 7), (4, 9, 1), (3, 3, 5)]:
        for other in ("frames", "classes"):  # frames: the same lengths, chunks agree; classes: half as long
            sizes, steps = {"data": size, other: size}, {"data": step, other: step}
            mins = {"data": lo, other: lo}
            checked += check_chunking(order, lengths, sizes, steps, mins)
    assert checked >= 5


def check_chunking(order, lengths, sizes, steps, mins):
    per_key = [
        {len(chunks_by_loop([i], {k: lengths[k]}, {k: sizes[k]}, {k: steps[k]}, mins)) for k in sizes} for i in order
    ]
    if any(len(c) > 1 for c in per_key):  # the keys disagree somewhere: an error naming that sequence
        first = int(order[next(j for j, c in enumerate(per_key) if len(c) > 1)])
        with pytest.raises(DataError, match=f"chunking of sequence 'seq-{first}'"):
            chunk_arrays(order, lengths, sizes, steps, mins)
        return False
    seq_idx, spans = chunk_arrays(order, lengths, sizes, steps, mins)
    assert entries_of(seq_idx, spans) == chunks_by_loop(order, lengths, sizes, steps, mins)
    return True


def greedy(cols, max_seqs):
    """The greedy rule over several (lengths, limit) columns, as the reference."""
    out, start, maxima = [], 0, [0] * len(cols)
    for j in range(len(cols[0][0])):
        n = j - start
        if n and (n >= max_seqs or any(max(m, c[j]) * (n + 1) > lim for m, (c, lim) in zip(maxima, cols))):
            out.append((start, j))
            start, maxima = j, [0] * len(cols)
        maxima = [max(m, c[j]) for m, (c, _) in zip(maxima, cols)]
    if len(cols[0][0]) > start:
        out.append((start, len(cols[0][0])))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_large_and_per_key_batches_follow_the_greedy_rule(seed):
    """Large batches, oversize entries and two per-key limits: the ranges of the plain greedy rule."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(200, 2000))
    data, classes = rng.integers(1, 60, n), rng.integers(0, 30, n)
    data[rng.integers(0, n, 3)] = 5000  # oversize entries: batches of one
    for limit, max_seqs in [(10**4, n + 5), (3000, 100), (20000, 64), (600, 1000)]:
        got = plan_batches({"data": data}, n, limit, max_seqs)
        assert got == greedy([(data.tolist(), limit)], max_seqs), (limit, max_seqs)
        got = plan_batches({"data": data, "classes": classes}, n, {"data": limit, "classes": limit // 4}, max_seqs)
        assert got == greedy([(data.tolist(), limit), (classes.tolist(), limit // 4)], max_seqs)


def test_an_order_out_of_range_names_the_dataset():
    class BadOrder(ArrayDataset):
        def get_seq_order(self, epoch, **_):
            return [0, 1, 7]

    with pytest.raises(DataError, match=r"'BadOrder'.*order has indices \[7\] out of range \[0, 3\)"):
        batches(BadOrder(seqs(n=3)), batch_size=100)


# ---- sequences checked once ----------------------------------------------------------------------


def test_torch_items_are_read_once_per_batch_and_equal_the_full_check_every_epoch():
    data = seqs()
    items = Items(data)
    ds = TorchDataset(items, seq_ordering="random")
    pipe = Pipeline(ds, extern_data=SPEC, batch_size=30, max_seqs=6)
    for epoch in (1, 2, 3):
        pipe.set_epoch(epoch)
        before = items.reads
        out = list(pipe)
        assert items.reads - before == len(data)  # one read per sequence and epoch, no extra check reads
        for b in out:
            assert_fields_equal(b.fields, full_check(ArrayDataset(data), b))


def test_lengths_that_change_after_the_first_epoch_are_read_again():
    """A dataset whose sequences grow between reads (not deterministic): the noted lengths no longer add up,
    so the lengths come from the arrays again."""

    class Growing(torch.utils.data.Dataset):
        calls = 0

        def __len__(self):
            return 12

        def __getitem__(self, i):
            Growing.calls += 1
            t = 1 + i % 4 + Growing.calls // 12  # every full pass one frame longer
            return {"data": torch.full((t, 3), float(t)), "classes": torch.zeros(t, dtype=torch.int64)}

    pipe = Pipeline(TorchDataset(Growing()), extern_data=SPEC, batch_size=10**6, max_seqs=4)
    for epoch in (1, 2, 3):
        pipe.set_epoch(epoch)
        for b in pipe:
            x, lengths = b["data"].tensor, b["data"].lengths
            for row in range(b.num_seqs):  # each row's length is its own value (t frames of t)
                t = int(lengths[row])
                assert bool((x[row, :t] == t).all()) and bool((x[row, t:] == 0).all())


def test_a_key_whose_dtype_differs_between_sequences_gives_the_full_check_batches_later():
    """Epoch 1 meets int32 labels in one batch and int64 in the other; epoch 2 mixes them in one batch."""
    data = seqs(n=20, dtype=np.int64)
    for s in data[:10]:
        s["classes"] = s["classes"].astype(np.int32)
    ds = TorchDataset(Items(data), seq_ordering=lambda epoch, **_: "default" if epoch == 1 else "random")
    pipe = Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=10)
    assert [b.seq_idx for b in pipe] == [list(range(10)), list(range(10, 20))]
    pipe.set_epoch(2)
    mixed = list(pipe)
    assert any(min(b.seq_idx) < 10 <= max(b.seq_idx) for b in mixed)
    for b in mixed:
        assert b["classes"].dtype == torch.int64
        assert_fields_equal(b.fields, full_check(ArrayDataset(data), b))


def test_items_with_keys_to_convert_are_converted_in_every_batch():
    class NumpyKeys(Items):
        def __getitem__(self, i):
            return {np.str_(k): v for k, v in super().__getitem__(i).items()}

    data = seqs(n=10)
    pipe = Pipeline(TorchDataset(NumpyKeys(data)), extern_data=SPEC, batch_size=10**6, max_seqs=4)
    for epoch in (1, 2):
        pipe.set_epoch(epoch)
        for b in pipe:
            assert all(type(k) is str for k in b) and list(b) == ["data", "classes"]
            assert_fields_equal(b.fields, full_check(ArrayDataset(data), b))


def test_a_bad_item_after_good_ones_is_still_named():
    class TurnsBad(Items):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return [item["data"]] if self.reads > 40 and i == 3 else item

    pipe = Pipeline(TorchDataset(TurnsBad(seqs(n=20)), lengths=[{"data": 1, "classes": 1}] * 20),
                    extern_data=SPEC, batch_size=10**6, max_seqs=5)
    list(pipe)  # reads 1..20
    pipe.set_epoch(2)
    list(pipe)  # reads 21..40, every sequence seen before
    pipe.set_epoch(3)
    with pytest.raises(DataError, match=r"item 3: expected a non-empty dict key -> array, got list"):
        list(pipe)


def test_a_label_out_of_range_in_equal_length_packed_rows_names_its_sequence():
    data = seqs(n=12, max_len=1)  # every sequence one frame: the rows are taken whole
    data[7]["classes"] = np.array([9])
    ds = ArrayDataset(data)
    assert ds.packed() is not None
    with pytest.raises(DataError, match=r"'classes' in sequence 'seq-7'.*label 9"):
        list(batches(ds, extern_data=SPEC, batch_size=10**6, max_seqs=5))


def test_a_loader_travels_without_what_it_learnt():
    ds = TorchDataset(Items(seqs(n=8)))
    loader = BatchLoader(ds, Pipeline(ds, extern_data=SPEC).extern_data)
    entries = [(i, None) for i in (3, 1, 6)]
    first = loader.load(entries)
    copy = pickle.loads(pickle.dumps(loader))
    assert_fields_equal(copy.load(entries).fields, first.fields)
    assert_fields_equal(loader.load(entries).fields, first.fields)  # the second time from the notes


def test_a_dataset_with_its_own_order_is_planned_from_it():
    class Reversed(ArrayDataset):
        def get_seq_order(self, epoch, **_):
            return list(range(len(self)))[::-1]

    assert isinstance(Reversed(seqs(n=3)), Dataset)
    out = list(batches(Reversed(seqs(n=5)), batch_size=10**6, max_seqs=2))
    assert [b.seq_idx for b in out] == [[4, 3], [2, 1], [0]]


def test_given_lengths_are_not_taken_for_the_items_own():
    """``lengths=`` only orders and batches: wrong ones (two swapped, the same total) still give the real lengths."""
    data = [{"data": np.ones((t, 3), np.float32) * t, "classes": np.zeros(t, np.int64)} for t in (2, 5, 3, 4)]
    given = [{"data": t, "classes": t} for t in (5, 2, 3, 4)]
    out = list(batches(TorchDataset(Items(data), lengths=given), extern_data=SPEC, batch_size=10**6))
    assert out[0]["data"].lengths.tolist() == [2, 5, 3, 4] and out[0]["classes"].lengths.tolist() == [2, 5, 3, 4]
    assert float(out[0]["data"].tensor[0, 2:].abs().sum()) == 0.0  # padded after its 2 real frames


class Frames(Dataset):
    """Numpy sequences read anew on each access (no packed storage), as a file-backed dataset gives them;
    ``dtype_after``: once ``later`` is set, the frames come in that dtype (the same kind)."""

    def __init__(self, data, dtype_after=None, **kwargs):
        super().__init__(**kwargs)
        self.data, self.dtype_after, self.reads, self.later = data, dtype_after, 0, False

    @property
    def num_seqs(self):
        return len(self.data)

    def get_seq(self, idx):
        self.reads += 1
        seq = {k: v.copy() for k, v in self.data[idx].items()}
        if self.dtype_after is not None and self.later:
            seq["data"] = seq["data"].astype(self.dtype_after)
        return seq


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("dtype_after", [None, np.float64])
def test_frames_go_straight_into_their_padded_rows(workers, dtype_after):
    """Each sequence's frames are copied into its row (no joined copy), first sight or not: the same batches, padding
    zero, cast to the declared dtype, in the main process and in a worker's shared memory."""
    data = seqs(n=24, max_len=30)
    ds = Frames(data, dtype_after=dtype_after, seq_ordering="random")
    opts = {"num_workers": workers} if workers else {}
    pipe = Pipeline(ds, extern_data=SPEC, batch_size=80, max_seqs=6, **opts)
    try:
        for epoch in (1, 2, 3):
            pipe.set_epoch(epoch)
            ds.later = epoch > 1
            out = list(pipe)
            assert sorted(i for b in out for i in b.seq_idx) == list(range(24))
            assert any(len(set(b["data"].lengths.tolist())) > 1 for b in out)  # rows of different lengths
            for b in out:
                assert b["data"].dtype == torch.float32
                assert_fields_equal(b.fields, full_check(ArrayDataset(data), b))
    finally:
        pipe.close()


def test_frames_seen_before_with_a_wrong_shape_later_name_their_sequence():
    data = seqs(n=10)

    class Turns(Frames):
        turned = False

        def get_seq(self, idx):
            seq = super().get_seq(idx)
            if self.turned and idx == 4:
                seq["data"] = seq["data"][:, :2]
            return seq

    ds = Turns(data)
    pipe = Pipeline(ds, extern_data=SPEC, batch_size=10**6, max_seqs=5)
    list(pipe)
    pipe.set_epoch(2)
    ds.turned = True
    with pytest.raises(DataError, match=r"'data'.*seq-4"):
        list(pipe)
