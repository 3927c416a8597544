"""RETURNN's run-time keys in kit's engine: memory switches, batch size lines, forward order, key registry."""

from __future__ import annotations

import logging
import os

import pytest

import kit
from kit.compat.returnn_keys import RETURNN_KEYS
from kit.engine.run_hooks import MemoryWatcher, set_cuda_alloc_conf
from tests.helpers.models import Task12AXDataset, tiny_config

# the keys of issue 28 that RETURNN's torch engine reads: each has RETURNN's meaning in kit now
RUN_TOOL_KEYS = ["calculate_exp_loss", "log_grad_norm", "epoch_start", "epoch_end", "startup_callback", "watch_memory",
                 "reset_dev_memory_caches", "log_batch_size", "sort_dataset", "packed_batch_size", "use_lovely_tensors",
                 "PYTORCH_CUDA_ALLOC_CONF", "wandb_opts"]


@pytest.mark.parametrize("name", RUN_TOOL_KEYS)
def test_run_tool_keys_are_kit_keys(name):
    assert RETURNN_KEYS[name].status == "kit"


def test_every_unsupported_key_warns_and_tf_only_ones_say_why(caplog):
    with caplog.at_level(logging.WARNING, logger="kit"):
        kit.Config(tiny_config(forward_batch_size=10))
    assert "'forward_batch_size'" in caplog.text
    assert "TensorFlow" in RETURNN_KEYS["forward_batch_size"].note


def _small(**keys):
    return tiny_config(num_epochs=1, train=Task12AXDataset(20, seed=1), dev=Task12AXDataset(6, seed=2), **keys)


def test_log_batch_size_lines_only_at_verbosity_5(caplog):
    for verbosity, want in ((5, True), (3, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kit"):
            session = kit.Session(**_small(log_batch_size=True, log_verbosity=verbosity))
            batches: list = []
            session.on("step_begin", _keep(batches))
            session.train_steps(2)
            session.close()
        lines = [r.getMessage() for r in caplog.records if "batch size:" in r.getMessage()]
        assert bool(lines) == want
        if want:
            b = batches[0]
            assert lines[0] == (f"ep 1 train step 0 batch size: num_seqs {b.num_seqs}, "
                                f"max_size:data {b['data'].tensor.shape[1]}, sum_size:data {int(b['data'].lengths.sum())}, "
                                f"max_size:classes {b['classes'].tensor.shape[1]}, "
                                f"sum_size:classes {int(b['classes'].lengths.sum())}")


def _keep(into: list):
    def keep(batch, **_):
        into.append(batch)

    return keep


def test_packed_batch_size_bounds_the_summed_lengths():
    sizes = []
    session = kit.Session(**_small(packed_batch_size=120, batch_size=10_000, max_seqs=100))
    session.on("step_begin", lambda batch, **_: sizes.append((batch.num_seqs, int(batch["data"].lengths.sum()),
                                                              int(batch["data"].lengths.max()))))
    session.train_epoch()
    session.close()
    assert all(total <= 120 or n == 1 for n, total, _ in sizes)
    assert any(n > 1 for n, _, _ in sizes)  # it packs more than one where they fit


def test_forward_order_follows_sort_dataset():
    seen = {}
    for sort in (True, False):
        session = kit.Session(**_small(sort_dataset=sort))
        order: list = []
        session.forward(Task12AXDataset(6, seed=3), callback=_Recorder(order))
        session.close()
        seen[sort] = order
    assert seen[False] == sorted(seen[False], key=lambda t: int(t.split("-")[-1]))  # the dataset's own order
    assert seen[True] != seen[False]


class _Recorder:
    def __init__(self, tags):
        self.tags = tags

    def init(self, **_):
        pass

    def process_seq(self, *, seq_tag, outputs, **_):
        self.tags.append(seq_tag)

    def finish(self, **_):
        pass


def test_watch_memory_reports_growth_and_children():
    watcher = MemoryWatcher()
    first = watcher.check()
    assert first[0].startswith(f"MEMORY: main proc {os.getpid()} initial: rss=") and first[-1].startswith("MEMORY: total")
    assert watcher.check() == []  # nothing changed
    ballast = bytearray(300 * 1024 * 1024)  # grows the RSS past the next shown size
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert any("increased RSS" in line for line in watcher.check())
    del ballast


def test_cuda_alloc_conf_is_set_or_refused(monkeypatch, caplog):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert not set_cuda_alloc_conf("expandable_segments:True", distributed=True)
    assert "does not work with torch_distributed" in caplog.text and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        assert set_cuda_alloc_conf("expandable_segments:True", distributed=False)
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_lovely_tensors_missing_is_a_warning(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "lovely_tensors", None)  # import fails as if not installed
    with caplog.at_level(logging.WARNING, logger="kit"):
        session = kit.Session(**_small(use_lovely_tensors=True))
        session.setup()
        session.close()
    assert "could not import lovely_tensors" in caplog.text


def test_reset_dev_memory_caches_collects_before_epochs_and_eval(monkeypatch):
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc") or 0)
    session = kit.Session(**_small(reset_dev_memory_caches=True))
    session.train_epoch()
    session.close()
    assert len(calls) >= 2  # the train epoch's start and the eval
