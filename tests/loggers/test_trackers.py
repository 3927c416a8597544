"""Trackers (kit.loggers): each runs for real without a network and its logged values are read back."""

from __future__ import annotations

import csv
import math
import os

import pytest

import kit
from kit.loggers import config_trackers
from kit.loggers.base import Tracker
from tests.helpers.models import Task12AXDataset, tiny_config


def _small(prefix, **keys):
    """One short epoch (about five steps)."""
    return tiny_config(None if prefix is None else str(prefix), num_epochs=1, train=Task12AXDataset(30, seed=1), dev=Task12AXDataset(10, seed=2),
                       **keys)


def _train(prefix, **keys):
    session = kit.Session(**_small(prefix, **keys))
    steps: list = []
    session.on("step_end", lambda result, **_: steps.append((result.global_train_step, result.losses, result.learning_rate)))
    session.train()
    row = session.engine.epoch_scores(1)
    session.close()
    return steps, row


def _expected_epoch(row):
    out = {"learning_rate": row["learning_rate"]}
    for key, value in row.items():
        if key != "learning_rate":
            dataset, name = kit.scores.split_score_key(key)
            out[f"{dataset}/{name}"] = value
    return out


def _check(logged_steps: dict, logged_epoch: dict, steps, row, every: int, rel: float = 0.0):
    """``logged_steps``: step -> {name: value}; ``logged_epoch``: {name: value} at the epoch end."""
    want_steps = {g: {**{f"train_step/{k}": v for k, v in losses.items()}, "train_step/learning_rate": lr}
                  for g, losses, lr in steps if g % every == 0}
    assert sorted(logged_steps) == sorted(want_steps)
    for g, values in want_steps.items():
        for name, value in values.items():
            assert math.isclose(logged_steps[g][name], value, rel_tol=rel, abs_tol=0), (g, name)
    for name, value in _expected_epoch(row).items():
        assert math.isclose(logged_epoch[name], value, rel_tol=rel), name


def test_csv_log_holds_every_step_and_epoch_value(tmp_path):
    steps, row = _train(tmp_path / "model", csv_log={"log_every_n_train_steps": 2}, calculate_exp_loss=True)
    with open(tmp_path / "model.log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    end = steps[-1][0] + 1  # epoch values sit at the global step of the epoch end
    logged: dict = {}
    for r in rows:
        logged.setdefault(int(r["global_train_step"]), {})[r["name"]] = float(r["value"])
    epoch = logged.pop(end)
    _check(logged, epoch, steps, row, every=2)  # repr of the float: exact
    assert "train_step/ce:exp" in logged[0] and "train/ce:exp" in epoch


def test_nothing_is_logged_unless_asked(tmp_path, monkeypatch):
    """wandb, mlflow and tensorboard are installed here: none of them switches itself on."""
    monkeypatch.chdir(tmp_path)
    _train(tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in os.listdir(tmp_path) if p.startswith("model."))
    assert not [p for p in os.listdir(tmp_path) if p.endswith((".csv", ".db", ".tensorboard")) or p == "wandb"]


def test_installed_tracker_packages_are_not_even_imported(tmp_path):
    import subprocess
    import sys

    code = ("import sys, kit\n"
            "from tests.helpers.models import tiny_config\n"
            f"s = kit.Session(**tiny_config({str(tmp_path / 'model')!r}, num_epochs=1))\n"
            "s.train_steps(2); s.close()\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


def test_wandb_offline_run_holds_returnns_metric_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from tests.loggers.wandb_file import history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    opts = {"project": "kit-test", "dir": str(tmp_path), "log_every_n_train_steps": 2, "id": "run1",
            "settings": {"x_disable_stats": True, "console": "off", "save_code": False}}
    steps, row = _train(tmp_path / "model", wandb_opts=opts)
    (run_dir,) = [p for p in (tmp_path / "wandb").glob("offline-run-*")]
    rows, run = history(str(run_dir))
    assert run["run_id"] == "run1" and run["job_type"] == "train" and run["project"] == "kit-test"
    merged: dict = {}
    for r in rows:
        merged.setdefault(r["_step"], {}).update(r)
    assert all(r["epoch"] == 1 for r in merged.values())
    end = steps[-1][0] + 1
    epoch = merged.pop(end)
    step_rows = {g: {k: v for k, v in r.items() if k.startswith("train_step/")} for g, r in merged.items()}
    _check(step_rows, epoch, steps, row, every=2)


def test_mlflow_through_log_to_reads_back(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    session = kit.Session(**_small(tmp_path / "model"))
    tracker = session.log_to("mlflow", experiment_name="exp", run_name="first", log_every_n_train_steps=3)
    steps: list = []
    session.on("step_end", lambda result, **_: steps.append((result.global_train_step, result.losses, result.learning_rate)))
    session.train()
    row = session.engine.epoch_scores(1)
    session.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/model.mlflow.db")
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.params["learning_rate"] == "0.01" and run.data.params["batch_size"] == "600"
    logged: dict = {}
    for name in run.data.metrics:
        for m in client.get_metric_history(tracker.run_id, name):
            logged.setdefault(m.step, {})[name] = m.value
    epoch = logged.pop(steps[-1][0] + 1)
    _check({g: {k: v for k, v in r.items() if k != "epoch"} for g, r in logged.items()}, epoch, steps, row, every=3)


def test_tensorboard_through_log_to_and_the_old_import_path(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import kit.tensorboard
    from kit.loggers.tensorboard import TensorBoardLogger

    assert kit.tensorboard.TensorBoardLogger is TensorBoardLogger
    session = kit.Session(**_small(tmp_path / "model"))
    tracker = session.log_to("tensorboard", log_every_n_train_steps=1)
    session.train_steps(3)
    tracker.close()  # off again: the next steps are not logged
    session.train_steps(1)
    session.close()
    acc = EventAccumulator(tracker.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/ce")] == [0, 1, 2]


class _Recorder(Tracker):
    def __init__(self):
        super().__init__(log_every_n_train_steps=1)
        self.seen: list = []

    def log_metrics(self, metrics, *, step, epoch):
        self.seen.append(step)


def test_rank_zero_only_unless_all_ranks(tmp_path, monkeypatch):
    config = kit.Config(_small(tmp_path / "model", csv_log=True))
    events = kit.events.Events()
    assert config_trackers(config, events, training=True, rank=1, step=lambda: 0) == []
    assert config_trackers(config, events, training=False, rank=0, step=lambda: 0) == []
    config.update(csv_log={"all_ranks": True})
    (tracker,) = config_trackers(config, events, training=True, rank=1, step=lambda: 0)
    assert tracker.path == f"{tmp_path}/model.rank1.log.csv"
    tracker.close()
    session = kit.Session(**_small(tmp_path / "model2"))
    monkeypatch.setenv("RANK", "2")
    assert session.log_to(_Recorder()) is None
    monkeypatch.setenv("RANK", "0")
    recorder = session.log_to(_Recorder())
    session.train_steps(2)
    session.close()
    assert recorder.seen == [0, 1]


def test_bad_tracker_options_name_the_key(tmp_path):
    with pytest.raises(kit.ConfigError, match="wandb_opts"):
        kit.Config(_small(tmp_path / "m", wandb_opts="yes"))
    session = kit.Session(**_small(None))
    with pytest.raises(kit.ConfigError, match="csv_log.*model"):
        session.log_to("csv")
    with pytest.raises(kit.ConfigError, match="unknown tracker"):
        session.log_to("neptune")
    session.close()
