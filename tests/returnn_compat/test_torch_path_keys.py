"""Keys RETURNN's torch path reads, with RETURNN's meaning in kit (issue 28): grad_clip, start_batch,
allow_skipping_seqs_in_forward, dataset_random_seed_offset."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers.models import tiny_config

import kit
from kit.data import Task12AXDataset, make_dataset
from kit.engine.engine import Engine
from kit.errors import ConfigError


@pytest.mark.parametrize("value", [1.0, 5])
def test_grad_clip_is_refused_as_returnn_refuses_it(value):
    with pytest.raises(ConfigError, match="gradient_clip_global_norm"):
        kit.Config(grad_clip=value)


def test_grad_clip_zero_is_accepted_as_in_returnn():
    assert kit.Config(grad_clip=0.0).typed_value("grad_clip") == 0.0  # negative control: RETURNN checks `if grad_clip`


def test_start_batch_other_than_auto_is_an_error():
    assert kit.Config(start_batch="auto").typed_value("start_batch") == "auto"
    with pytest.raises(ConfigError, match="start_batch"):
        kit.Config(start_batch=3)


def _forward_step(*, model, extern_data, **_kwargs):
    data = extern_data["data"]
    kit.get_run_ctx().mark_as_output(model(data.tensor), "logits", lengths=data.lengths)


def _forward(**overrides):
    engine = Engine(kit.Config(tiny_config(None, forward_step=_forward_step, **overrides)))
    engine.setup()
    try:
        return engine.forward(Task12AXDataset(12, seed=3))
    finally:
        engine.close()


def test_forward_with_a_length_filter_needs_allow_skipping_seqs_in_forward(caplog):
    lengths = [int(Task12AXDataset(12, seed=3).get_seq_length(i)["data"]) for i in range(12)]
    cut = sorted(lengths)[6]
    assert len(_forward()) == 12  # negative control: no filter, every sequence
    with pytest.raises(ConfigError, match="allow_skipping_seqs_in_forward"):
        _forward(max_seq_length=cut)
    with caplog.at_level(logging.WARNING, logger="kit"):
        result = _forward(max_seq_length=cut, allow_skipping_seqs_in_forward=True)
    assert len(result) == sum(n <= cut for n in lengths) < 12
    assert any("allow_skipping_seqs_in_forward is enabled" in r.getMessage() for r in caplog.records)


def _kit_order(config: kit.Config, epoch: int) -> list[int]:
    return list(make_dataset(config.typed_value("train")).get_seq_order(epoch))


def test_dataset_random_seed_offset_is_every_dataset_dicts_default_offset():
    data = [{"data": np.zeros((t, 2), np.float32)} for t in range(1, 30)]
    spec = {"class": "StaticDataset", "data": data, "seq_ordering": "random"}
    shifted = kit.Config(dataset_random_seed_offset=7, train=spec)
    own = kit.Config(train=dict(spec, random_seed_offset=7))
    plain = kit.Config(train=spec)
    assert _kit_order(shifted, 1) == _kit_order(own, 1)
    assert _kit_order(shifted, 1) != _kit_order(plain, 1)  # negative control: the offset changes the order
    kept = kit.Config(dataset_random_seed_offset=7, train=dict(spec, random_seed_offset=2))
    assert kept.typed_value("train")["random_seed_offset"] == 2  # the dataset's own offset wins, as in RETURNN


def test_dataset_random_seed_offset_equals_returnns_order():
    config_mod = pytest.importorskip("returnn.config", reason="parity needs RETURNN (pip install returnn)")
    from returnn.datasets import init_dataset

    data = [{"data": np.zeros((t % 11 + 1, 2), np.float32)} for t in range(40)]
    spec = {"class": "StaticDataset", "data": data, "seq_ordering": "random"}
    with config_mod.global_config_ctx(config_mod.Config({"dataset_random_seed_offset": 7})):
        ds = init_dataset(dict(spec))
        orders = []
        for epoch in (1, 2):
            ds.init_seq_order(epoch=epoch)
            orders.append([int(i) for i in ds.get_current_seq_order()])
    config = kit.Config(dataset_random_seed_offset=7, train=spec)
    assert [_kit_order(config, e) for e in (1, 2)] == orders
