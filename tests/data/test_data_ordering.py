"""Sequence orderings and partition_epoch."""

import numpy as np
import pytest

from kit.data import ArrayDataset, Dataset
from kit.data.ordering import parse, seq_order
from kit.errors import ConfigError

ORDERINGS = [
    "default",
    "reverse",
    "sorted",
    "sorted_reverse",
    "random",
    "random:3",
    "laplace:5",
    "laplace:.10",
    "laplace:.10:7",
    "sort_bin_shuffle:4",
    "sort_bin_shuffle_x2:.10",
]


def make_ds(n=103, **opts) -> ArrayDataset:
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 200, size=n)
    return ArrayDataset([{"data": np.zeros((int(t), 2), np.float32)} for t in lens], **opts)


def lens_of(ds, order):
    return [ds.get_seq_length(i)["data"] for i in order]


@pytest.mark.parametrize("method", ORDERINGS)
def test_every_ordering_is_a_permutation(method):
    ds = make_ds(seq_ordering=method)
    for epoch in (1, 2):
        order = ds.get_seq_order(epoch)
        assert sorted(order) == list(range(ds.num_seqs))


@pytest.mark.parametrize("method", ORDERINGS)
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_partitions_tile_the_full_epoch(method, parts):
    full = make_ds(seq_ordering=method, random_seed=5)
    part = make_ds(seq_ordering=method, partition_epoch=parts, random_seed=5)
    for full_epoch in (1, 2):
        pieces = [part.get_seq_order((full_epoch - 1) * parts + p + 1) for p in range(parts)]
        assert sum(pieces, []) == full.get_seq_order(full_epoch)
        sizes = [len(p) for p in pieces]
        assert max(sizes) - min(sizes) <= 1


def test_default_reverse_sorted():
    ds = make_ds()
    assert ds.get_seq_order(1) == list(range(103))
    assert ds.get_seq_order(1, seq_ordering="reverse") == list(range(102, -1, -1))
    lens = lens_of(ds, ds.get_seq_order(1, seq_ordering="sorted"))
    assert lens == sorted(lens)
    lens = lens_of(ds, ds.get_seq_order(1, seq_ordering="sorted_reverse"))
    assert lens == sorted(lens, reverse=True)


def test_laplace_zigzag_of_lengths():
    ds = make_ds(n=100, seq_ordering="laplace:.10")
    lens = lens_of(ds, ds.get_seq_order(1))
    bins = [lens[i : i + 10] for i in range(0, 100, 10)]
    for i, b in enumerate(bins):
        assert b == sorted(b, reverse=i % 2 == 1), f"bin {i} not sorted in its direction: {b}"
    # not simply sorted overall: the bins are random subsets
    assert lens != sorted(lens)
    # "laplace:B" means B bins (RETURNN): 4 bins of 25
    lens4 = lens_of(ds, ds.get_seq_order(1, seq_ordering="laplace:4"))
    for i in range(4):
        b = lens4[i * 25 : (i + 1) * 25]
        assert b == sorted(b, reverse=i % 2 == 1)


def test_sort_bin_shuffle_bins_are_length_ranges():
    ds = make_ds(n=100)
    lens = lens_of(ds, ds.get_seq_order(1, seq_ordering="sort_bin_shuffle:4"))
    bins = [lens[i * 25 : (i + 1) * 25] for i in range(4)]
    assert all(b == sorted(b) for b in bins)
    assert sorted(bins, key=min) != bins or sorted(lens) != lens  # bins were shuffled (seeded)
    ranges = sorted((min(b), max(b)) for b in bins)
    assert all(ranges[i][1] <= ranges[i + 1][0] for i in range(3))


@pytest.mark.parametrize("method", ["random", "laplace:.10", "sort_bin_shuffle_x2:5"])
def test_random_orders_deterministic_and_differ_between_epochs(method):
    a, b = make_ds(seq_ordering=method, random_seed=1), make_ds(seq_ordering=method, random_seed=1)
    assert a.get_seq_order(3) == b.get_seq_order(3)
    assert a.get_seq_order(1) != a.get_seq_order(2)
    other_seed = make_ds(seq_ordering=method, random_seed=2)
    assert other_seed.get_seq_order(1) != a.get_seq_order(1)


def test_random_n_keeps_the_shuffle_for_n_epochs():
    """RETURNN's "random:n": the same shuffle for n consecutive epochs, then a new one."""
    ds = make_ds()
    orders = [ds.get_seq_order(e, seq_ordering="random:2") for e in (1, 2, 3, 4, 5)]
    assert orders[0] == orders[1] != orders[2] == orders[3] != orders[4]
    assert ds.get_seq_order(1, seq_ordering="random:1") == ds.get_seq_order(1, seq_ordering="random")


def test_config_seed_leaves_the_order_and_dataset_seeds_change_it():
    """As in RETURNN: the order depends on epoch, fixed_random_seed and random_seed_offset only."""
    free = make_ds(seq_ordering="random")
    assert free.get_seq_order(1, random_seed=1) == free.get_seq_order(1, random_seed=2)
    offset = make_ds(seq_ordering="random", random_seed_offset=9)
    assert offset.get_seq_order(1) != free.get_seq_order(1)
    assert make_ds(seq_ordering="random", random_seed=9).get_seq_order(1) == offset.get_seq_order(1)
    fixed = make_ds(seq_ordering="random", fixed_random_seed=3)
    assert fixed.get_seq_order(1) == fixed.get_seq_order(2) != free.get_seq_order(1)


def test_random_sample_draws_with_replacement_deterministically():
    ds = make_ds(seq_ordering="random_sample")
    order = ds.get_seq_order(1)
    assert len(order) == ds.num_seqs and len(set(order)) < ds.num_seqs
    assert order == ds.get_seq_order(1) != ds.get_seq_order(2)


def test_default_every_n_interleaves_streams():
    ds = make_ds(n=10)
    assert ds.get_seq_order(1, seq_ordering="default_every_n:3") == [0, 3, 6, 1, 4, 7, 2, 5, 8]


def test_callable_seq_ordering_is_called_with_the_epoch():
    ds = make_ds(seq_ordering=lambda epoch, **_: "default" if epoch == 1 else "reverse")
    assert ds.get_seq_order(1) == list(range(103))
    assert ds.get_seq_order(2) == list(range(102, -1, -1))


def test_small_laplace_has_two_bins_as_in_returnn():
    ds = make_ds(n=15)
    lens = lens_of(ds, ds.get_seq_order(1, seq_ordering="laplace:.10"))
    assert lens[:7] == sorted(lens[:7]) and lens[7:] == sorted(lens[7:], reverse=True)


@pytest.mark.parametrize("bad", ["shuffle", "random:x", "sorted:3", "laplace:.0", "random:.3", "default_every_n", ""])
def test_bad_orderings_raise_config_error(bad):
    with pytest.raises(ConfigError, match="seq_ordering"):
        parse(bad)
    with pytest.raises(ConfigError):
        ArrayDataset([{"data": np.zeros(3)}], seq_ordering=bad)


def test_seq_order_function_only_loads_lengths_when_needed():
    def boom():
        raise AssertionError("lengths must not be needed")

    assert seq_order("random", num_seqs=5, epoch=1, seq_len=boom, random_seed=0) != []
    with pytest.raises(AssertionError):
        seq_order("sorted", num_seqs=5, epoch=1, seq_len=boom)


def test_base_class_defaults():
    class Squares(Dataset):
        num_seqs = 4

        def get_seq(self, idx):
            return {"data": np.zeros((idx + 1, 2)), "n": np.array(idx)}

    ds = Squares(seq_ordering="sorted_reverse")
    assert len(ds) == 4
    assert ds.get_seq_tag(2) == "seq-2"
    assert ds.get_seq_index("seq-3") == 3
    assert ds.get_seq_length(2) == {"data": 3}  # scalar key has no time axis
    assert ds.get_seq_order(1) == [3, 2, 1, 0]
    with pytest.raises(KeyError, match="nope"):
        ds.get_seq_index("nope")
