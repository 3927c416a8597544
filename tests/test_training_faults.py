"""Faults during real training: kill -9 (mid-save, at random instants), damaged and malicious files.

A killed run, restarted with the same config, resumes from the last complete checkpoint and
ends with exactly the parameters, optimizer state, losses and scores of an uninterrupted run
(:func:`helpers.training_script.reference_run`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.faults import flip_byte, truncate_file, write_malicious_checkpoint
from helpers.training_script import STEPS_PER_EPOCH, config, copy_run, reference_run, train

import kit
from kit import checkpoints
from kit.engine.engine import Engine
from kit.errors import UnsafeCheckpointError
from kit.fileio import TEMP_MARK

SCRIPT = Path(__file__).resolve().parent / "helpers" / "training_script.py"
NUM_STEPS = 2 * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(str(tmp_path_factory.getbasetemp() / "reference"))


def assert_same_as(result, reference, losses_from: int):
    assert [s for s, _, _ in result.losses] == list(range(losses_from, NUM_STEPS))
    assert result.losses == reference.losses[losses_from:]
    assert all(torch.equal(result.state[k], reference.state[k]) for k in reference.state)
    assert str(result.optimizer) == str(reference.optimizer)
    assert result.scaler == reference.scaler
    assert result.scores == reference.scores


def temp_files(prefix) -> list[str]:
    return glob.glob(f"{glob.escape(os.path.dirname(prefix))}/*{TEMP_MARK}*")


class Scripts:
    """Training scripts started ahead (they import torch meanwhile) and let go one at a time."""

    def __init__(self, n: int, prefix, overrides=None, **env):
        args = [sys.executable, str(SCRIPT), str(prefix), json.dumps(overrides or {})]
        kwargs = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.waiting = [subprocess.Popen(args, env={**os.environ, **env}, **kwargs) for _ in range(n)]

    def go(self) -> subprocess.Popen:
        proc = self.waiting.pop(0)
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.close()
        return proc

    def close(self) -> None:
        for proc in self.waiting:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()


@pytest.fixture
def scripts():
    started = []

    def start(n, prefix, overrides=None, **env) -> Scripts:
        started.append(Scripts(n, prefix, overrides, **env))
        return started[-1]

    yield start
    for s in started:
        s.close()


def kill(proc: subprocess.Popen) -> int:
    """kill -9; returns the last train step the script reported (-1: none)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    rest = proc.stdout.read().split()
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, "the training script ended before it was killed"
    steps = [int(rest[i + 1]) for i, word in enumerate(rest[:-1]) if word == "step"]
    return max(steps, default=-1)


def wait_for_step(proc: subprocess.Popen, step: int) -> None:
    """Until the script reports train step ``step`` or a later one (it may resume after it)."""
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= step:
            return
        assert line.strip() != "done", f"the training script finished before step {step}"
    raise AssertionError(f"the training script ended (rc {proc.wait()}) before step {step}")


def check_score_file(prefix: str, last_step: int) -> None:
    """After a kill: the file parses; rows with train scores are whole, finished epochs 1..k."""
    path = f"{prefix}.scores.json"
    if not os.path.exists(path):
        assert last_step < STEPS_PER_EPOCH
        return
    table = kit.ScoreTable.load(path)
    trained = [e for e in table.epochs if table.has_scores(e, "train_loss_")]
    assert trained == list(range(1, len(trained) + 1))
    for epoch in trained:
        assert table.has_scores(epoch, "dev_loss_")
        assert last_step >= epoch * STEPS_PER_EPOCH - 1, (
            f"epoch {epoch} has train scores but was not finished"
        )
    newest = checkpoints.latest(prefix)
    finished = 0 if newest is None else newest.epoch if newest.kind == "epoch" else newest.epoch - 1
    assert finished <= len(trained) <= finished + 1


# ---- kill -9 ------------------------------------------------------------------------------------


def test_kill_during_a_checkpoint_save_resumes_from_the_last_complete_one(tmp_path, reference, scripts):
    prefix = str(tmp_path / "model")
    overrides = {"save_every_n_steps": None}
    proc = scripts(1, prefix, overrides, KIT_TEST_SLOW_WRITE_SECS="0.2").go()
    deadline = time.monotonic() + 120
    while not glob.glob(f"{glob.escape(prefix)}.002.opt.pt{TEMP_MARK}*"):  # model.002.pt is written already
        assert proc.poll() is None and time.monotonic() < deadline, "no save of epoch 2 seen"
        time.sleep(0.005)
    kill(proc)

    half = [c for c in checkpoints.list_checkpoints(prefix) if c.name == "model.002"]
    assert half and not half[0].complete and os.path.exists(half[0].path)
    assert checkpoints.latest(prefix).name == "model.001"
    assert temp_files(prefix)
    check_score_file(prefix, last_step=NUM_STEPS - 1)  # epoch 2 finished: its row was written before the save

    result = train(prefix, **overrides)
    assert_same_as(result, reference, losses_from=STEPS_PER_EPOCH)
    assert not temp_files(prefix)
    checkpoints.verify(checkpoints.latest(prefix))
    assert checkpoints.latest(prefix).name == "model.002"
    assert kit.ScoreTable.load(f"{prefix}.scores.json").epochs == [1, 2]


def test_kill_at_random_instants_then_restart_ends_like_an_uninterrupted_run(tmp_path, reference, scripts):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prefix = str(tmp_path / "model")
    targets = sorted(rng.sample(range(1, NUM_STEPS - 2), 3))
    print(f"random seed {seed}: kills after train steps {targets}")  # shown when the test fails
    ahead = scripts(len(targets), prefix, KIT_TEST_STEP_DELAY="0.01")
    resumed_at = 0
    for target in targets:
        proc = ahead.go()
        wait_for_step(proc, target)
        time.sleep(rng.uniform(0.0, 0.05))  # lands in a step, a step checkpoint, or the epoch end
        last_step = max(target, kill(proc))
        check_score_file(prefix, last_step)
        newest = checkpoints.latest(prefix)
        resumed_at = 0 if newest is None else newest.global_train_step
        assert resumed_at <= last_step + 1, f"seed {seed}"

    result = train(prefix)
    assert_same_as(result, reference, losses_from=resumed_at)
    assert not temp_files(prefix)
    table = kit.ScoreTable.load(f"{prefix}.scores.json")
    assert table.epochs == [1, 2] and all(table.has_scores(e, "train_loss_") for e in (1, 2))


# ---- damaged newest checkpoint --------------------------------------------------------------------


def damage(ckpt, how: str) -> None:
    if how == "missing_train_state":
        os.unlink(ckpt.opt_path)
    elif how == "flipped_byte":
        flip_byte(ckpt.path)
    elif how == "truncated_train_state":
        truncate_file(ckpt.opt_path, 0.5)
    else:
        os.unlink(ckpt.manifest_path)


@pytest.mark.parametrize(
    "how", ["missing_train_state", "flipped_byte", "truncated_train_state", "missing_manifest"]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_verified_one(
    tmp_path, reference, caplog, how
):
    prefix = copy_run(reference, tmp_path)
    newest = checkpoints.latest(prefix)
    assert newest.name == "model.002"
    damage(newest, how)
    with caplog.at_level(logging.WARNING, logger="kit"):
        result = train(prefix)
    assert "Skipping checkpoint model.002" in caplog.text
    assert_same_as(result, reference, losses_from=35)  # from the step checkpoint before it
    checkpoints.verify(checkpoints.latest(prefix))


# ---- malicious files --------------------------------------------------------------------------------


def forge_newest_checkpoint(prefix: str, marker, evil_file: str) -> None:
    """A checkpoint of epoch 3 whose manifest matches its files: only unpickling can tell."""
    good = checkpoints.checkpoint_paths(prefix, 2)
    paths = checkpoints.checkpoint_paths(prefix, 3)
    for i, name in enumerate(("model", "train_state")):
        if name == evil_file:
            write_malicious_checkpoint(paths[i], marker)
        else:
            shutil.copy(good[i], paths[i])
    manifest = json.loads(Path(good[2]).read_text())
    manifest.update(epoch=3, global_train_step=NUM_STEPS + 19)
    for i, name in enumerate(("model", "train_state")):
        data = Path(paths[i]).read_bytes()
        manifest["files"][name] = {
            "name": os.path.basename(paths[i]),
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    Path(paths[2]).write_text(json.dumps(manifest))


@pytest.mark.parametrize("evil_file", ["model", "train_state"])
def test_a_malicious_newest_checkpoint_is_refused_on_resume(tmp_path, reference, evil_file):
    prefix = copy_run(reference, tmp_path)
    marker = tmp_path / "pwned"
    forge_newest_checkpoint(prefix, marker, evil_file)
    newest = checkpoints.latest(prefix)
    assert newest.name == "model.003"  # it verifies
    with pytest.raises(UnsafeCheckpointError, match=r"model\.003.*'posix\.system'|model\.003.*'os\.system'"):
        Engine(config(prefix, num_epochs=4)).setup()
    with pytest.raises(UnsafeCheckpointError):
        kit.Session(config(prefix, num_epochs=4)).setup()
    assert not marker.exists()


@pytest.mark.parametrize("key", ["load", "import_model_train_epoch1", "load_for_eval"])
def test_a_malicious_file_given_as_load_or_import_is_refused(tmp_path, key):
    marker = tmp_path / "pwned"
    evil = write_malicious_checkpoint(tmp_path / "evil.pt", marker, "touch")
    engine = Engine(config(tmp_path / "model", **{key.removesuffix("_for_eval"): evil}))
    if key == "load_for_eval":
        engine.task = "eval"
    with pytest.raises(UnsafeCheckpointError, match="touch_marker"):
        engine.setup()
    assert not marker.exists()
