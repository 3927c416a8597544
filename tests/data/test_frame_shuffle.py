"""HDFDataset's ``shuffle_frames_of_nseqs`` (RETURNN's): the frames of each group of n sequences of the
epoch's order are permuted among them; lengths kept, deterministic, the same on resume, eval unshuffled."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("h5py")

from kit.config import Config  # noqa: E402
from kit.data import make_dataset  # noqa: E402
from kit.data.hdf import HDFDataset, write_hdf  # noqa: E402
from kit.data.pipeline import Pipeline  # noqa: E402
from kit.engine.parts import build_datasets  # noqa: E402
from kit.errors import ConfigError, DataError  # noqa: E402

LENS = [3, 5, 2, 4, 6, 3, 1]  # 7 sequences: with n=3 the last group is one sequence


def _write(path, lens=LENS, classes_lens=None):
    """Frame t of sequence i holds the value 100*i + t in 'data' and in its aligned 'classes'."""
    seqs = []
    for i, n in enumerate(lens):
        v = np.arange(n) + 100 * i
        c = v if classes_lens is None else np.arange(classes_lens[i]) + 100 * i
        seqs.append({"data": np.stack([v, -v], 1).astype("float32"), "classes": c.astype("int32")})
    write_hdf(path, seqs)
    return str(path)


def _epoch(ds, epoch=1, **opts):
    """Per sequence of the epoch (in the order's order): (dataset index, data[:, 0], classes) from real batches."""
    opts.setdefault("max_seqs", 1)
    p = Pipeline(ds, batch_size=10_000, **opts)
    p.set_epoch(epoch)
    out = []
    for b in p:
        for j in range(b.num_seqs):
            n = int(b["data"].lengths[j])
            out.append((b["data"].tensor[j, :n, 0].numpy().astype(int), b["classes"].tensor[j, :n].numpy()))
    return p, out


@pytest.mark.parametrize("opts", [{}, {"seq_ordering": "random"}, {"seq_ordering": "random", "partition_epoch": 2}])
def test_each_group_is_a_permutation_of_its_frames(tmp_path, opts):
    path = _write(tmp_path / "a.hdf")
    ds = HDFDataset(path, shuffle_frames_of_nseqs=3, **opts)  # a partition: groups of the sub-epoch's order
    p, got = _epoch(ds)
    order = ds.seq_order_array(1)
    assert [len(d) for d, _ in got] == [LENS[i] for i in order]  # lengths kept
    changed = 0
    for g in range(0, len(order), 3):
        members = order[g : g + 3]
        frames = np.concatenate([d for d, _ in got[g : g + 3]])
        want = np.concatenate([np.arange(LENS[i]) + 100 * i for i in members])
        assert sorted(frames.tolist()) == sorted(want.tolist())  # the group's frames, each once
        changed += not np.array_equal(frames, want)
    assert changed >= 2  # negative control: the frames did move
    for d, c in got:
        assert np.array_equal(d, c)  # the aligned target got the same permutation
    rs = np.random.RandomState(0).permutation(sum(LENS[i] for i in order[:3]))  # RETURNN's seed: the group start
    want0 = np.concatenate([np.arange(LENS[i]) + 100 * i for i in order[:3]])[rs]
    assert np.array_equal(np.concatenate([d for d, _ in got[:3]]), want0)


def test_zero_is_the_file_as_it_is(tmp_path):
    path = _write(tmp_path / "a.hdf")
    _, got = _epoch(HDFDataset(path, shuffle_frames_of_nseqs=0))
    assert all(np.array_equal(d, np.arange(LENS[i]) + 100 * i) for i, (d, _) in enumerate(got))
    _, plain = _epoch(HDFDataset(path))
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(got, plain))


def test_deterministic_across_epochs_and_instances(tmp_path):
    path = _write(tmp_path / "a.hdf")
    same = [_epoch(HDFDataset(path, shuffle_frames_of_nseqs=2), epoch=e)[1] for e in (1, 2)]  # default order
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(*same))
    rnd = HDFDataset(path, shuffle_frames_of_nseqs=2, seq_ordering="random")
    e1, e2, e1_again = (_epoch(rnd, epoch=e)[1] for e in (1, 2, 1))
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(e1, e1_again))
    assert any(len(a) != len(b) or not np.array_equal(a, b) for (a, _), (b, _) in zip(e1, e2))  # another order


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_with_chunking_gives_the_same_frames(tmp_path, prefetch):
    path = _write(tmp_path / "a.hdf", lens=[7, 9, 4, 8, 11, 6, 5, 10])
    opts = dict(chunking="3:2", batch_size=6, max_seqs=2, prefetch=prefetch)

    def run(resume_at=None):
        p = Pipeline(HDFDataset(path, shuffle_frames_of_nseqs=3, seq_ordering="random"), **opts)
        p.set_epoch(2)
        if resume_at is not None:
            p.load_state_dict({"epoch": 2, "position": resume_at, "num_batches": len(p)})
        out = [b["data"].tensor.numpy().copy() for b in p]
        p.close()
        return out

    full = run()
    for k in (1, len(full) // 2, len(full) - 1):
        tail = run(resume_at=k)
        assert len(tail) == len(full) - k and all(np.array_equal(a, b) for a, b in zip(tail, full[k:]))
    plain = Pipeline(HDFDataset(path, seq_ordering="random"), **opts)
    plain.set_epoch(2)
    assert any(not np.array_equal(a, b["data"].tensor.numpy()) for a, b in zip(full, plain))  # negative control


def test_worker_processes_give_the_same_frames(tmp_path):
    path = _write(tmp_path / "a.hdf")

    def run(**opts):
        p = Pipeline(HDFDataset(path, shuffle_frames_of_nseqs=3, seq_ordering="random"), batch_size=20, max_seqs=3,
                     **opts)
        out = []
        for epoch in (1, 2):  # the workers get each epoch's groups
            p.set_epoch(epoch)
            out += [b["data"].tensor.numpy().copy() for b in p]
        p.close()
        return out

    alone, workers = run(), run(num_workers=2)
    assert len(alone) == len(workers) and all(np.array_equal(a, b) for a, b in zip(alone, workers))


def test_config_key_reaches_train_datasets_only(tmp_path):
    path = _write(tmp_path / "a.hdf")
    spec = {"class": "HDFDataset", "files": [path]}
    ds = build_datasets(Config({"train": spec, "dev": spec, "eval_datasets": {"e": spec}, "shuffle_frames_of_nseqs": 2}))
    assert ds["train"].shuffle_frames_of_nseqs == 2
    assert ds["dev"].shuffle_frames_of_nseqs == 0 and ds["eval_datasets.e"].shuffle_frames_of_nseqs == 0
    _, dev = _epoch(ds["dev"])
    assert all(np.array_equal(d, np.arange(LENS[i]) + 100 * i) for i, (d, _) in enumerate(dev))
    own = build_datasets(Config({"train": {**spec, "shuffle_frames_of_nseqs": 3}, "shuffle_frames_of_nseqs": 2}))
    assert own["train"].shuffle_frames_of_nseqs == 3  # the dict's own option wins, as in RETURNN
    assert build_datasets(Config({"train": spec}))["train"].shuffle_frames_of_nseqs == 0


def test_refusals_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="shuffle_frames_of_nseqs"):
        build_datasets(Config({"train": {"class": "Task12AXDataset", "num_seqs": 4}, "shuffle_frames_of_nseqs": 2}))
    bad = _write(tmp_path / "b.hdf", classes_lens=[2, 5, 2, 4, 6, 3, 1])
    with pytest.raises(DataError, match="'classes' of sequence 0 has 2 frames"):
        HDFDataset(bad, shuffle_frames_of_nseqs=2)
    HDFDataset(bad)  # negative control: without the shuffle the file is fine
    with pytest.raises(ConfigError, match="int >= 0"):
        HDFDataset(bad, shuffle_frames_of_nseqs=-1)
    child = {"class": "HDFDataset", "files": [_write(tmp_path / "a.hdf")], "shuffle_frames_of_nseqs": 2}
    with pytest.raises(ConfigError, match="shuffle_frames_of_nseqs"):
        make_dataset({"class": "MetaDataset", "datasets": {"a": child}, "data_map": {"data": ("a", "data")}})
