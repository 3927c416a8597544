"""Forward on new raw input: a dataset without the targets that only training reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import tiny_config

import kit
from kit.data import ArrayDataset, Task12AXDataset
from kit.engine.engine import Engine


def forward_step(*, model, extern_data, **_kwargs):
    data = extern_data["data"]
    kit.get_run_ctx().mark_as_output(model(data.tensor).argmax(-1), "labels", lengths=data.lengths)


def reads_targets(*, model, extern_data, **_kwargs):
    kit.get_run_ctx().mark_as_output(extern_data["classes"].tensor, "classes")


def engine_with(step) -> Engine:
    engine = Engine(kit.Config(tiny_config(None, forward_step=step)))
    engine.setup()
    return engine


def inputs_only(n: int = 5) -> tuple[Task12AXDataset, ArrayDataset]:
    labelled = Task12AXDataset(n, seed=3)
    seqs = [{"data": labelled.get_seq(i)["data"]} for i in range(n)]
    raw = ArrayDataset(seqs, seq_tags=[f"new-{i}" for i in range(n)])
    return labelled, raw


def test_input_without_targets_gives_the_same_outputs_as_with_them():
    engine = engine_with(forward_step)
    labelled, raw = inputs_only()
    with_targets, without = engine.forward(labelled), engine.forward(raw)
    assert list(without) == [f"new-{i}" for i in range(len(raw))]
    for i in range(len(raw)):
        expected = with_targets[labelled.get_seq_tag(i)]["labels"]
        np.testing.assert_array_equal(without[f"new-{i}"]["labels"], expected)


def test_a_forward_step_that_reads_the_missing_key_names_it():
    engine = engine_with(reads_targets)
    _, raw = inputs_only()
    with pytest.raises(KeyError, match="classes"):
        engine.forward(raw)


def test_the_keys_forward_keeps_are_still_checked():
    engine = engine_with(forward_step)
    bad = ArrayDataset([{"data": np.zeros((4, 3), "float32")}])  # extern_data says 9 features
    with pytest.raises(kit.DataError, match="data"):
        engine.forward(bad)
    assert torch.is_grad_enabled()
