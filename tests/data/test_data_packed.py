"""The fast data path: packed datasets and joined batches give exactly the per-sequence batches."""

import pickle

import numpy as np
import pytest
import torch

from kit.data import ArrayDataset, CharTextDataset, Pipeline, TorchDataset, batches
from kit.data.batching import plan_batches
from kit.data.collate import BatchLoader, collate
from kit.data.packed import PackedKey
from kit.errors import DataError

SPEC = {"data": {"shape": (None, 3)}, "classes": {"shape": (None,), "sparse_dim": 5}}


class PerSeq(ArrayDataset):
    """The same data, loaded through get_seq one sequence at a time (no packed fast path)."""

    def get_seq(self, idx):
        return super().get_seq(idx)


class CountingTags(ArrayDataset):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag_calls = 0

    def get_seq_tag(self, idx):
        self.tag_calls += 1
        return super().get_seq_tag(idx)


def seqs(n=23, seed=0, dtype=np.float64, extra=True, max_len=8):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, max_len + 1))
        seq = {"data": rng.normal(size=(t, 3)).astype(dtype), "classes": rng.integers(0, 5, t).astype(np.int32)}
        if extra:
            seq["speaker"] = np.array(rng.integers(0, 4))  # 0-dim, not declared
            seq["frames"] = rng.normal(size=(t, 2))  # declared nowhere, has time
        out.append(seq)
    return out


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.seq_idx == y.seq_idx and x.seq_tags == y.seq_tags and list(x) == list(y)
        for key in x:
            fx, fy = x[key], y[key]
            assert fx.tensor.dtype == fy.tensor.dtype and torch.equal(fx.tensor, fy.tensor), key
            assert fx.sparse_dim == fy.sparse_dim
            assert (fx.lengths is None) == (fy.lengths is None)
            if fx.lengths is not None:
                assert fx.lengths.dtype == torch.int32 and torch.equal(fx.lengths, fy.lengths)


@pytest.mark.parametrize("extern_data", [SPEC, None])
@pytest.mark.parametrize(
    "opts",
    [
        {"batch_size": 20},
        {"batch_size": 1000, "max_seqs": 4, "seq_ordering": "random"},
        {"batch_size": 30, "chunking": (3, 2)},
        {"batch_size": 50, "chunking": ({"data": 4, "classes": 4, "frames": 4}, 4)},
        {"batch_size": 400, "max_len": 60},
    ],
)
def test_packed_batches_equal_per_sequence_batches(extern_data, opts):
    opts = dict(opts)
    data = seqs(max_len=opts.pop("max_len", 8))
    fast, slow = ArrayDataset(data), PerSeq(data)
    assert fast.packed() is not None and slow.packed() is None  # both paths really run
    a = list(batches(fast, extern_data=extern_data, **opts))
    b = list(batches(slow, extern_data=extern_data, **opts))
    assert_same_batches(a, b)
    if extern_data is not None:
        assert a[0]["data"].tensor.dtype == torch.float32 and a[0]["classes"].tensor.dtype == torch.int64
    else:
        assert a[0]["data"].tensor.dtype == torch.float64 and a[0]["classes"].tensor.dtype == torch.int32
    assert a[0]["speaker"].lengths is None and a[0]["frames"].lengths is not None


@pytest.mark.parametrize("max_len", [8, 60])  # short rows: one masked gather; long rows: a copy per row
def test_padding_is_zero_and_rows_are_the_sequences(max_len):
    data = seqs(extra=False, max_len=max_len)
    (b,) = list(batches(ArrayDataset(data), extern_data=SPEC, batch_size=10**6))
    for row, seq in enumerate(data):
        t = len(seq["classes"])
        assert b["data"].lengths[row] == t
        assert np.array_equal(b["data"].tensor[row, :t].numpy(), seq["data"].astype(np.float32))
        assert not b["data"].tensor[row, t:].any() and not b["classes"].tensor[row, t:].any()


def test_mixed_layouts_are_not_packed_and_still_load():
    mixed = [{"data": np.zeros((2, 3), np.float32)}, {"data": np.zeros((4, 3), np.float64)}]
    ds = ArrayDataset(mixed)
    assert ds.packed() is None
    (b,) = list(batches(ds, batch_size=100))
    assert b["data"].tensor.dtype == torch.float64 and b["data"].lengths.tolist() == [2, 4]
    assert ArrayDataset([{"a": np.zeros(2)}, {"b": np.zeros(2)}]).packed() is None  # different keys


def errors(ds, **opts):
    with pytest.raises(DataError) as err:
        list(batches(ds, extern_data=SPEC, batch_size=10**6, **opts))
    return str(err.value)


@pytest.mark.parametrize(
    "bad",
    [
        {"data": np.zeros((4, 2), np.float32)},  # axis 1
        {"data": np.zeros((4, 3, 1), np.float32)},  # rank
        {"data": np.zeros((4, 3), np.int64)},  # dtype kind
        {"classes": np.zeros(4, np.float32)},  # dtype kind of labels
    ],
)
def test_a_wrong_layout_has_the_same_message_on_both_paths(bad):
    data = [dict(s, **bad) for s in seqs(n=5, extra=False)]
    fast, slow = ArrayDataset(data, seq_tags=list("abcde")), PerSeq(data, seq_tags=list("abcde"))
    assert fast.packed() is not None
    msg = errors(fast)
    assert msg == errors(slow)
    assert "'a'" in msg and "expected" in msg and "received" in msg


def test_label_out_of_range_raises_at_its_batch_naming_its_sequence():
    data = seqs(n=6, extra=False)
    data[4]["classes"][0] = 7
    tags = [f"utt{i}" for i in range(6)]
    ds = ArrayDataset(data, seq_tags=tags)
    assert ds.packed() is not None
    pipe = batches(ds, extern_data=SPEC, batch_size=10**6, max_seqs=3)
    first = next(pipe)  # sequences 0-2 are fine
    assert first.seq_idx == [0, 1, 2]
    with pytest.raises(DataError, match=r"'classes' in sequence 'utt4'.*out of range.*label 7"):
        next(pipe)
    assert errors(ds, max_seqs=3).split("(")[0] == errors(PerSeq(data, seq_tags=tags), max_seqs=3).split("(")[0]


def test_missing_declared_key_names_it_on_the_packed_path():
    ds = ArrayDataset([{"data": np.zeros((2, 3), np.float32)}] * 3)
    msg = errors(ds)
    assert "'classes' is missing in sequence 'seq-0'" in msg and "expected" in msg


def test_seq_tags_are_built_only_when_read():
    ds = CountingTags(seqs(n=8), seq_tags=[f"t{i}" for i in range(8)])
    got = list(batches(ds, extern_data=SPEC, batch_size=20))
    assert ds.tag_calls == 0  # loading and padding never build a tag
    assert [t for b in got for t in b.seq_tags] == [f"t{i}" for i in range(8)]
    assert ds.tag_calls == 8
    copy = pickle.loads(pickle.dumps(got[0]))  # to another process: the tags go as strings
    assert copy.seq_tags == got[0].seq_tags and copy.num_seqs == got[0].num_seqs
    two = next(b for b in got if b.num_seqs >= 2)
    sub = two.select([1])
    assert sub.seq_tags == [two.seq_tags[1]] and sub.seq_idx == [two.seq_idx[1]]


class Items(torch.utils.data.Dataset):
    def __init__(self, data, grad=False):
        self.items = [{k: torch.tensor(v, requires_grad=grad and v.dtype.kind == "f") for k, v in s.items()} for s in data]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("grad", [False, True])
def test_torch_dataset_tensors_give_the_array_batches(grad):
    data = seqs(extra=False)
    a = list(batches(TorchDataset(Items(data, grad)), extern_data=SPEC, batch_size=25, chunking=(3, 3)))
    b = list(batches(ArrayDataset(data), extern_data=SPEC, batch_size=25, chunking=(3, 3)))
    assert_same_batches(a, b)


def test_torch_dataset_wrong_tensor_is_named():
    data = seqs(n=4, extra=False)
    data[2]["data"] = np.zeros((3, 4))
    with pytest.raises(DataError, match=r"'data' in sequence 'seq-2': wrong size of axis 1: expected 3, received 4"):
        list(batches(TorchDataset(Items(data)), extern_data=SPEC, batch_size=10**6))


def test_mixed_tensors_and_arrays_are_joined():
    seqs_ = [{"x": torch.zeros(2, 3)}, {"x": np.ones((1, 3), np.float32)}]
    fields = collate(seqs_, ["a", "b"])
    assert fields["x"].tensor.tolist() == [[[0.0] * 3, [0.0] * 3], [[1.0] * 3, [0.0] * 3]]


@pytest.mark.parametrize("max_len", [8, 60])
def test_packed_with_workers_equals_without(max_len):
    data = seqs(n=40, seed=3, max_len=max_len)
    ref = Pipeline(ArrayDataset(data), extern_data=SPEC, batch_size=30, chunking=(4, 3))
    par = Pipeline(ArrayDataset(data), extern_data=SPEC, batch_size=30, chunking=(4, 3), num_workers=2)
    try:
        for epoch in (1, 2):
            ref.set_epoch(epoch)
            par.set_epoch(epoch)
            assert_same_batches(list(ref), list(par))
    finally:
        par.close()


def test_char_text_packed_windows_equal_get_seq():
    ds = CharTextDataset("dev", max_files=20)
    assert ds.packed() is not None
    loader = BatchLoader(ds, None)
    entries = [(i, None) for i in range(0, min(len(ds), 30), 3)]
    fast = loader.load(entries)
    slow = collate([ds.get_seq(i) for i, _ in entries], [ds.get_seq_tag(i) for i, _ in entries])
    for key in ("data", "classes"):
        assert torch.equal(fast[key].tensor, slow[key].tensor) and torch.equal(fast[key].lengths, slow[key].lengths)


def test_packed_key_from_arrays_and_views():
    pk = PackedKey.from_arrays([np.arange(3), np.arange(5)])
    assert pk.seq(1).tolist() == list(range(5)) and pk.fixed_length is None
    assert PackedKey.from_arrays([np.zeros((2, 1))] * 3).fixed_length == 2


def greedy(lengths, limit, max_seqs):
    """The plain greedy batching rule, as the reference for the fast paths."""
    out, start, longest = [], 0, 0
    for j, length in enumerate(lengths):
        n = j - start
        if n and (n >= max_seqs or max(longest, length) * (n + 1) > limit):
            out.append((start, j))
            start, longest = j, 0
        longest = max(longest, length)
    if len(lengths) > start:
        out.append((start, len(lengths)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batch_plan_fast_paths_equal_the_greedy_rule(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    lens = rng.integers(1, 5 if seed % 2 else 60, n)
    for limit in (10, 200, 10**6):
        for max_seqs in (1, 7, 64, n, n + 5):
            got = plan_batches({"data": lens}, n, limit, max_seqs)
            assert got == greedy(lens.tolist(), limit, max_seqs), (limit, max_seqs)
    assert plan_batches({"data": lens}, n, None, 7) == greedy(lens.tolist(), 10**18, 7)
