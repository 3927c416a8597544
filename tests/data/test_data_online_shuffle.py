"""RETURNN's ``online_shuffle_batches``: train batches shuffled within consecutive blocks of the
buffer size, ``complete_frac`` kept in order, the same order again for the same epoch and seed."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.models import tiny_config

import kit
from kit.data import Pipeline, Task12AXDataset
from kit.engine.engine import Engine


def epoch_batches(buffer, *, epoch: int = 1, train: bool = True, seed: int = 42):
    pipe = Pipeline(Task12AXDataset(200, seed=1, seq_ordering="random"), extern_data=Task12AXDataset.extern_data,
                    batch_size=400, max_seqs=8, train=train, random_seed=seed, online_shuffle_batches=buffer)
    pipe.set_epoch(epoch)
    return [(tuple(b.seq_idx), b.complete_frac) for b in pipe]


def test_batches_are_shuffled_within_blocks_and_complete_frac_stays_in_order():
    plain, shuffled = epoch_batches(None), epoch_batches(4)
    assert len(plain) == len(shuffled) > 8
    assert [f for _, f in shuffled] == [f for _, f in plain]  # by position, as RETURNN's monotonic keys
    blocks = range(0, len(plain), 4)
    for start in blocks:  # each block holds the same batches, in another order
        assert sorted(s for s, _ in shuffled[start:start + 4]) == sorted(s for s, _ in plain[start:start + 4])
    assert [s for s, _ in shuffled] != [s for s, _ in plain]


def test_the_order_is_the_same_for_the_same_epoch_and_seed_and_differs_otherwise():
    first = [s for s, _ in epoch_batches(4)]
    assert first == [s for s, _ in epoch_batches({"buffer_size": 4})]  # a resumed epoch plans it again
    assert first != [s for s, _ in epoch_batches(4, seed=7)]
    plain2 = sorted(s for s, _ in epoch_batches(None, epoch=2))
    assert sorted(s for s, _ in epoch_batches(4, epoch=2)) == plain2 and first != [s for s, _ in epoch_batches(4, epoch=2)]


def test_eval_batches_are_never_shuffled():
    assert epoch_batches(4, train=False) == epoch_batches(None, train=False)


@pytest.mark.parametrize("bad", [0, -1, True, "4", {"size": 4}, {"buffer_size": 0}])
def test_a_bad_value_is_a_config_error_naming_the_key(bad):
    with pytest.raises(kit.ConfigError, match="online_shuffle_batches"):
        Engine(kit.Config(tiny_config(num_epochs=1, online_shuffle_batches=bad))).train()


def test_training_with_it_sees_every_sequence_once_per_epoch():
    seen: list[int] = []
    engine = Engine(kit.Config(tiny_config(num_epochs=1, online_shuffle_batches=3)))
    engine.events.on("step_begin", lambda batch, **_: seen.extend(batch.seq_idx))
    engine.train()
    assert sorted(seen) == sorted(np.unique(seen).tolist())  # no sequence twice
    assert len(seen) == len(engine.datasets["train"])
