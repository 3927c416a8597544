"""RETURNN's ``torch_batching``: a user's batcher over the streamed sequence dicts makes the batches kit
trains on (collated as kit's own); RETURNN's per-sequence dicts, ``train=``, resume, and the refusals.
Also ``packed_batch_size_train`` / ``_dev`` and ``packed_batch_cost``."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from helpers.models import tiny_config

import kit
from kit.data import Pipeline, Task12AXDataset

CALLS: list[dict] = []


class AlternateBatching(torch.utils.data.IterableDataset):
    """Batches of ``n`` sequences, alternating between even- and odd-length ones (a real setup's kind)."""

    def __init__(self, dataset, *, train: bool, n: int = 3, **kwargs):
        assert any(k.startswith("__fwd_compat") for k in kwargs)  # RETURNN's: user functions take **kwargs
        self.dataset, self.n = dataset, n
        CALLS.append({"train": train, "thread": threading.current_thread().name})

    def __iter__(self):
        bins: dict[int, list] = {0: [], 1: []}
        want = 0
        for seq in self.dataset:
            CALLS[-1].setdefault("first", seq)
            kind = seq["data"].shape[0] % 2
            bins[kind].append(seq)
            while len(bins[want]) >= self.n:
                yield bins[want][: self.n]
                bins[want] = bins[want][self.n :]
                want = 1 - want
        for kind in (want, 1 - want):
            for i in range(0, len(bins[kind]), self.n):
                yield bins[kind][i : i + self.n]


def data(n: int = 60) -> Task12AXDataset:
    return Task12AXDataset(n, seed=1, seq_ordering="random", random_seed_offset=8)


def plan_of(pipe: Pipeline) -> list[list[int]]:
    return [[int(i) for i, _ in batch] for batch in pipe.plan()]


def test_the_batchers_batches_are_the_ones_loaded_and_its_dicts_are_returnns():
    CALLS.clear()
    ds = data()
    pipe = Pipeline(ds, extern_data=Task12AXDataset.extern_data, torch_batching=AlternateBatching, train=True)
    pipe.set_epoch(2)
    assert CALLS[-1]["train"] is True and CALLS[-1]["thread"] == threading.current_thread().name
    order = ds.seq_order_array(2)
    first = CALLS[-1]["first"]
    assert sorted(first) == sorted(["data", "classes", "seq_tag", "seq_idx", "epoch", "num_seqs", "complete_frac"])
    assert all(isinstance(v, np.ndarray) for v in first.values())
    assert first["seq_tag"].dtype.kind == "U" and first["seq_tag"].shape == () and str(first["seq_tag"]) == ds.get_seq_tag(int(order[0]))
    assert (int(first["seq_idx"]), int(first["epoch"]), int(first["num_seqs"])) == (0, 2, len(ds))
    assert first["complete_frac"].dtype == np.float32 and float(first["complete_frac"]) == np.float32(1 / len(ds))
    np.testing.assert_array_equal(first["data"], ds.get_seq(int(order[0]))["data"])

    plan = plan_of(pipe)
    assert all(len(b) == 3 for b in plan[:4]) and sorted(sum(plan, [])) == sorted(order.tolist())
    parity = [{ds.get_seq_length(i)["data"] % 2 for i in b} for b in plan[:4]]
    assert parity == [{0}, {1}, {0}, {1}]  # alternating kinds, not the order's runs
    batches = list(pipe)
    assert [b.seq_idx for b in batches] == plan and len(batches) == pipe.num_batches
    plain = Pipeline(ds, extern_data=Task12AXDataset.extern_data, train=True, max_seqs=3, batch_size=10**6)
    plain.set_epoch(2)
    assert plan_of(plain) != plan  # negative control: kit's own batching groups them otherwise
    want = plain._loader.load([(i, None) for i in plan[0]])  # the same sequences collated by kit
    assert torch.equal(batches[0]["data"].tensor, want["data"].tensor)
    assert torch.equal(batches[0]["classes"].lengths, want["classes"].lengths)
    assert batches[-1].complete_frac == 1.0


def test_eval_gets_train_false_and_the_dict_form_without_returnn_says_what_to_install(monkeypatch):
    CALLS.clear()
    Pipeline(data(), torch_batching=AlternateBatching, train=False).set_epoch(1)
    assert CALLS[-1]["train"] is False
    monkeypatch.setitem(sys.modules, "returnn", None)  # RETURNN not installed
    monkeypatch.setitem(sys.modules, "returnn.torch.data", None)
    with pytest.raises(kit.ConfigError, match=r"torch_batching.*pip install returnn"):
        Pipeline(data(), torch_batching={"class": "BucketOrderingIterDataPipe", "buckets": [(20, 4)], "length_key": "data"})


class NewData(torch.utils.data.IterableDataset):
    def __init__(self, dataset, **_kwargs):
        self.dataset = dataset

    def __iter__(self):
        for seq in self.dataset:
            yield [{k: np.copy(v) for k, v in seq.items()}]


class NotIterable:
    def __init__(self, dataset, **_kwargs):
        pass


@pytest.mark.parametrize("batcher, match", [
    (NewData, "did not stream"), (NotIterable, "IterableDataset"), ("BucketOrdering", "expected a callable"),
])
def test_batchers_kit_cannot_follow_are_config_errors(batcher, match):
    with pytest.raises(kit.ConfigError, match=match):
        Pipeline(data(), torch_batching=batcher).set_epoch(1)


class SeqsOfTwo(torch.utils.data.IterableDataset):
    def __init__(self, dataset, **_kwargs):
        self.dataset = dataset

    def __iter__(self):
        batch = []
        for seq in self.dataset:
            batch.append(seq)
            if len(batch) == 2:
                yield batch
                batch = []
        if batch:
            yield batch


def test_training_resumed_mid_epoch_continues_bit_for_bit(tmp_path):
    cfg = dict(num_epochs=2, torch_batching=SeqsOfTwo, batch_size=10)  # batch_size: ignored, as in RETURNN
    ref = kit.Session(**tiny_config(str(tmp_path / "ref" / "model"), **cfg))
    steps: list[list[int]] = []
    ref.engine.events.on("step_begin", lambda batch, **_: steps.append(list(batch.seq_idx)))
    ref.train()
    assert all(len(s) == 2 for s in steps) and len(steps) == 2 * 60  # 120 sequences in pairs, per epoch
    s = kit.Session(**tiny_config(str(tmp_path / "run" / "model"), **cfg))
    s.train_epoch()
    s.train_steps(7)
    s.save()
    s.close()
    s2 = kit.Session(**tiny_config(str(tmp_path / "run" / "model"), **cfg))
    s2.setup()
    assert (s2.progress.epoch, s2.progress.step_in_epoch) == (2, 7)
    s2.train()
    want, got = ref.model.state_dict(), s2.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_packed_batch_size_per_split_and_packed_batch_cost():
    ds = data(40)
    lens = {k: v for k, v in ds.seq_lengths().items()}

    def sums(pipe):
        return [sum(int(lens["data"][i]) for i in b) for b in plan_of(pipe)]

    cfg = dict(batch_size=10**6, packed_batch_size=200, packed_batch_size_dev=50)
    train = Pipeline.from_config(ds, kit.Config(cfg), train=True)
    dev = Pipeline.from_config(ds, kit.Config(cfg), train=False)
    train.set_epoch(1), dev.set_epoch(1)
    assert max(sums(train)) <= 200 < max(sums(train)) + 50
    assert all(n <= 50 or len(b) == 1 for n, b in zip(sums(dev), plan_of(dev))) and max(sums(dev)) > 40
    assert Pipeline.from_config(ds, kit.Config({**cfg, "packed_batch_size_train": 50}), train=True).num_batches > train.num_batches
    cost = {"cells": lambda lengths: lengths["data"] * lengths["classes"]}
    pipe = Pipeline.from_config(ds, kit.Config(dict(batch_size=10**6, packed_batch_cost=cost,
                                                    packed_batch_size={"cells": 300})), train=True)
    pipe.set_epoch(1)
    cells = [sum(int(lens["data"][i] * lens["classes"][i]) for i in b) for b in plan_of(pipe)]
    assert all(c <= 300 or len(b) == 1 for c, b in zip(cells, plan_of(pipe))) and max(cells) > 200
    with pytest.raises(kit.ConfigError, match=r"explicit packed_batch_size entry"):
        Pipeline.from_config(ds, kit.Config(dict(packed_batch_cost=cost, packed_batch_size=300)), train=True).set_epoch(1)


def test_ddp_ranks_share_the_batchers_batches_as_kits_own():
    from kit.engine.distributed import _sharded_pipeline_class

    one = Pipeline(data(), torch_batching=SeqsOfTwo)
    one.set_epoch(1)
    ranks = []
    for rank in (0, 1):
        pipe = _sharded_pipeline_class()(data(), shard=(rank, 2, True), torch_batching=SeqsOfTwo)
        pipe.set_epoch(1)
        ranks.append(plan_of(pipe))
    assert ranks[0] == plan_of(one)[0::2] and ranks[1] == plan_of(one)[1::2]


def test_the_batcher_gets_the_chunks_after_the_length_filter_as_in_returnn():
    seen: list[dict] = []

    class Note(SeqsOfTwo):
        def __iter__(self):
            for batch in super().__iter__():
                seen.extend(batch)
                yield batch

    ds = data(30)
    pipe = Pipeline(ds, torch_batching=Note, chunking=(5, 3), min_seq_length=30, train=True)
    pipe.set_epoch(1)
    order = ds.seq_order_array(1).tolist()
    kept = [i for i in order if ds.get_seq_length(i)["data"] >= 30]
    assert 0 < len(kept) < len(order)  # the filter removed some: the stream skips them
    tags = list(dict.fromkeys(str(s["seq_tag"]) for s in seen))
    assert tags == [ds.get_seq_tag(i) for i in kept]  # chunks in order, each sequence's in a row
    first = [s for s in seen if str(s["seq_tag"]) == tags[0]]
    full = ds.get_seq(kept[0])["data"]
    assert [s["data"].shape[0] for s in first] == [min(5, len(full) - a) for a in range(0, len(full), 3)]
    np.testing.assert_array_equal(first[1]["data"], full[3:8])
    assert {int(s["seq_idx"]) for s in first} == {order.index(kept[0])}  # chunks keep their sequence's seq_idx


def test_the_loader_draws_follow_what_returnns_dataloader_would_iterate():
    """RETURNN's own batching and its online shuffle are torch datapipes (one more seed drawn); a batcher's plain
    IterableDataset is not (kit.engine.loader_draws)."""
    ds = data()
    own = Pipeline(ds, extern_data=Task12AXDataset.extern_data, batch_size=600, train=True)
    plain = Pipeline(ds, extern_data=Task12AXDataset.extern_data, torch_batching=AlternateBatching, train=True)
    shuffled = Pipeline(ds, extern_data=Task12AXDataset.extern_data, torch_batching=AlternateBatching, train=True,
                        online_shuffle_batches=4)
    for pipe in (own, plain, shuffled):
        pipe.set_epoch(1)
    assert (own.batches_are_datapipe, plain.batches_are_datapipe, shuffled.batches_are_datapipe) == (True, False, True)
