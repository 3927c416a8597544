"""``torch_profile``, ``session.profile(steps=n)`` and ``stop_for_resubmission_when_low_time_left``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import kit
from kit.engine.resubmission import ResubmissionCheck, parse_slurm_time
from kit.events import Events
from tests.helpers.models import Task12AXDataset, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = {"schedule": dict(wait=1, warmup=1, active=2, repeat=1), "profile_memory": False, "with_stack": False}


def _small(prefix, **keys):
    return tiny_config(str(prefix), **{"num_epochs": 2, "train": Task12AXDataset(30, seed=1),
                                        "dev": Task12AXDataset(6, seed=2), **keys})


def _trace_steps(path) -> set[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}


def test_torch_profile_writes_the_trace_and_stops_as_returnn(tmp_path):
    session = kit.Session(**_small(tmp_path / "model", torch_profile=FAST))
    result = session.train()
    assert result.outcome == "paused" and result.reason == "torch_profile"
    assert result.global_train_step == 5  # wait 1 + warmup 1 + active 2: stops after the step past the schedule
    assert _trace_steps(tmp_path / "torch_profile.json") == {"ProfilerStep#2", "ProfilerStep#3"}  # the active ones
    session.close()


def test_torch_profile_without_exit_trains_on_and_once_profiles_one_epoch(tmp_path):
    session = kit.Session(**_small(tmp_path / "model", torch_profile={**FAST, "exit_after_profile": False, "once": True}))
    assert session.train().outcome == "finished"
    assert (tmp_path / "torch_profile.json").is_file() and (tmp_path / "model.002.pt").is_file()
    session.close()


def test_no_trace_unless_asked(tmp_path):
    session = kit.Session(**_small(tmp_path / "model", num_epochs=1))
    session.train()
    session.close()
    assert not list(tmp_path.glob("torch_profile*"))


def test_session_profile_returns_top_ops_and_a_trace(tmp_path):
    session = kit.Session(**_small(tmp_path / "model"))
    session.train_steps(1)
    report = session.profile(steps=3, top=5)
    assert report.result.global_train_step + 1 == session.progress.global_train_step == 4  # 1 + 3 steps
    assert len(report.table) == 5 and {"name", "calls", "self_cpu_ms"} <= set(report.table.columns)
    assert report.table["self_cpu_ms"].is_monotonic_decreasing
    assert "aten::" in " ".join(report.table["name"])
    assert report.trace_path == str(tmp_path / "torch_profile.session-step1.json")
    assert _trace_steps(report.trace_path) == set() and os.path.getsize(report.trace_path) > 1000
    session.close()


@pytest.mark.parametrize("text, seconds", [("1-02:03:04", 93784), ("02:03:04", 7384), ("03:04", 184),
                                           ("UNLIMITED", None), ("", None)])
def test_slurm_time_strings(text, seconds):
    assert parse_slurm_time(text) == seconds


def test_resubmission_check_compares_time_left_with_the_last_epoch():
    asked, left = [], [100]
    check = ResubmissionCheck(1.2, asked.append, lambda: 5, time_left=lambda: left[0]).attach(Events())
    check.on_epoch_begin()
    check._began -= 80  # an epoch of 80 s: 96 s needed
    check.on_epoch_end(epoch=1)
    assert asked == []  # 100 s left
    left[0] = 90
    check.on_epoch_begin()
    check._began -= 80
    check.on_epoch_end(epoch=2)
    assert asked == ["low time left"]
    check.on_epoch_begin()
    check._began -= 80
    check.on_epoch_end(epoch=5)  # the final epoch: nothing to resubmit
    assert asked == ["low time left"]


CONFIG = textwrap.dedent("""
    import kit
    from tests.helpers.models import get_model, train_step, Task12AXDataset
    train = Task12AXDataset(30, seed=1)
    dev = Task12AXDataset(6, seed=2)
    extern_data = Task12AXDataset.extern_data
    batch_size, max_seqs, optimizer, learning_rate, num_epochs = 600, 10, {"class": "adam"}, 1e-2, 3
    save_interval = 5
    stop_for_resubmission_when_low_time_left = True
""")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_cli_stops_for_resubmission_as_returnn(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text("#!/bin/sh\necho 0:00:00\n")  # no time left
    squeue.chmod(0o755)
    (tmp_path / "cfg.py").write_text(CONFIG + f"model = {str(tmp_path / 'model')!r}\n")
    env = dict(os.environ, PYTHONPATH=ROOT, SLURM_JOB_ID="42", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # its own process group, as a job's: the SIGINT RETURNN sends goes to the group, not to this test
    proc = subprocess.run([sys.executable, "-m", "kit", "train", str(tmp_path / "cfg.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, start_new_session=True)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stop_for_resubmission_when_low_time_left: SLURM time_left=0s" in proc.stderr
    assert "stopped by low time left at epoch 2, step 0" in proc.stderr
    table = kit.ScoreTable.load(tmp_path / "model.scores.json")
    assert table.epochs == [1]  # stopped after epoch 1 (its checkpoint is the step checkpoint: save_interval 5)
    del env["SLURM_JOB_ID"]  # resubmitted without a time limit: continues with epoch 2 and finishes
    proc = subprocess.run([sys.executable, "-m", "kit", "train", str(tmp_path / "cfg.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kit.ScoreTable.load(tmp_path / "model.scores.json").epochs == [1, 2, 3]


def test_cli_exits_0_after_the_profile_and_writes_nothing_more(tmp_path, capsys):
    from kit.cli import main

    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.replace("stop_for_resubmission_when_low_time_left = True", "")
                   + f"model = {str(tmp_path / 'model')!r}\ntorch_profile = {FAST!r}\n")
    assert main(["-q", "train", str(cfg)]) == 0
    assert "stopped after torch profiling" in capsys.readouterr().err
    assert (tmp_path / "torch_profile.json").is_file()
    assert not list(tmp_path.glob("model.*.pt"))  # RETURNN exits after the profile: no checkpoint
