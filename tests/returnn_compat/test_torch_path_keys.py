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


def test_torch_watch_stall_dumps_the_stacks_when_no_step_begins(tmp_path, monkeypatch, caplog):
    from kit.engine import watch_stall

    monkeypatch.setattr(watch_stall, "find_py_spy", lambda: None)
    with (tmp_path / "stacks.txt").open("w") as out, caplog.at_level(logging.WARNING, logger="kit"):
        watcher = watch_stall.StallWatcher(timeout=0.2, repeat=1, out=out, poll=0.05).start()
        watcher.beat()  # a run began, then nothing
        watcher._thread.join(timeout=5)
        watcher.stop()
    assert watcher.dumps == 1
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "STALL: no progress" in text and "py-spy not found" in text
    assert "test_torch_watch_stall_dumps_the_stacks" in (tmp_path / "stacks.txt").read_text()  # this thread's stack


def test_torch_watch_stall_stays_quiet_while_steps_begin(caplog):
    import time

    from kit.engine.watch_stall import StallWatcher

    with caplog.at_level(logging.WARNING, logger="kit"):
        watcher = StallWatcher(timeout=0.3, poll=0.05).start()
        for _ in range(10):  # negative control: a step every 0.05 s is progress
            watcher.beat()
            time.sleep(0.05)
        watcher.stop()
    assert watcher.dumps == 0 and not any("STALL" in r.getMessage() for r in caplog.records)


def test_torch_watch_stall_watches_a_sessions_runs_not_the_pauses_between_them(tmp_path, caplog):
    """A notebook session idle between train calls is not stalled: no STALL line after its run ended."""
    import time

    config = tiny_config(model=str(tmp_path / "model"), torch_watch_stall={"timeout": 0.2, "repeat": 1}, num_epochs=1)
    with caplog.at_level(logging.WARNING, logger="kit"), kit.Session(config, live=False) as session:
        session.train()
        time.sleep(0.8)  # four timeouts with no step: the watcher looks, but no run is going
        assert not any("STALL" in r.getMessage() for r in caplog.records)


def test_torch_watch_stall_options():
    from kit.engine.watch_stall import watch_options

    assert watch_options(600) == {"timeout": 600.0}
    assert watch_options(None) is None
    kit.Config(torch_watch_stall={"timeout": 60, "repeat": 2})
    with pytest.raises(ConfigError, match="torch_watch_stall"):
        kit.Config(torch_watch_stall={"timeout": 60, "kill": True})


def test_torch_watch_stall_watches_while_training(tmp_path):
    import threading

    def watching() -> bool:
        return any(t.name == "kit torch_watch_stall" and t.is_alive() for t in threading.enumerate())

    seen: list[bool] = []
    engine = Engine(kit.Config(tiny_config(str(tmp_path / "m"), torch_watch_stall=600, num_epochs=1,
                                           epoch_end=lambda **_: seen.append(watching()))))
    try:
        engine.setup()
        engine.train()
    finally:
        engine.close()
    assert seen and all(seen) and not watching()


def test_epoch_names_the_checkpoint_of_the_eval_command():
    from kit.cli import _eval_epoch

    assert _eval_epoch(kit.Config(epoch=2)).typed_value("load_epoch") == 2
    assert _eval_epoch(kit.Config()).typed_value("load_epoch") is None  # negative control
    assert _eval_epoch(kit.Config(epoch=2, load="x.pt")).typed_value("load_epoch") is None  # load wins, as in RETURNN
    assert _eval_epoch(kit.Config(epoch=2, load_epoch=2)).typed_value("load_epoch") == 2
    with pytest.raises(ConfigError, match="have to match"):
        _eval_epoch(kit.Config(epoch=2, load_epoch=3))


def test_dry_run_reads_the_run_but_writes_nothing(tmp_path):
    """RETURNN's dry_run: the run continues from its newest checkpoint and trains, but not one file is written
    (no checkpoint, score file, lock, cleanup or event log); a save asked for by hand is refused."""
    prefix = tmp_path / "run" / "model"
    first = Engine(kit.Config(tiny_config(str(prefix), num_epochs=1)))
    try:
        first.setup()
        first.train()
    finally:
        first.close()
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in prefix.parent.iterdir()}
    assert "model.001.pt" in before  # negative control: without dry_run the run wrote
    engine = Engine(kit.Config(tiny_config(str(prefix), num_epochs=2, dry_run=True)))
    try:
        engine.setup()
        assert engine.progress.epoch == 2  # read: continues after model.001
        assert engine.train() is True and engine.progress.epoch == 3
        with pytest.raises(ConfigError, match="dry_run"):
            engine.save_checkpoint(kind="step")
    finally:
        engine.close()
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in prefix.parent.iterdir()}
    assert after == before
