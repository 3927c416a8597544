"""One loop for every driver: the same events in the same order (kit/events.py's pseudocode).

Every driver trains tests/helpers/ddp_config.py for two epochs: Session.train(), a mix of
train_step / train_steps / train_epoch calls, train_async, train_in_background, the CLI
(``python -m kit train``) and torchrun with two gloo ranks (rank 0's events).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import event_log

import kit
from kit.cli import main

TESTS = Path(__file__).resolve().parents[1]
CONFIG = TESTS / "helpers" / "ddp_config.py"
STEPS, RANK_STEPS = 13, 6  # train steps per epoch: one process, each of two ranks (floor(13 / 2))
EPOCHS = 2


def loop(steps: int, epochs: int = EPOCHS) -> list[tuple]:
    """The events of one training run, in the order of kit/events.py's pseudocode."""
    seq: list[tuple] = [("run_begin",), ("train_begin",)]
    for e in range(1, epochs + 1):
        seq.append(("epoch_begin", e))
        for s in range(steps):
            seq += [("step_begin", e, s), ("step_end", e, s)]
        seq += [("eval_begin",), ("eval_end",), ("checkpoint_saved",), ("epoch_end", e)]
    return seq + [("train_end",), ("run_end", "done")]


def without_runs(seq: list[tuple]) -> list[tuple]:
    return [k for k in seq if k[0] not in ("run_begin", "run_end")]


def session(tmp_path: Path) -> tuple[kit.Session, list[tuple]]:
    s = kit.Session.from_config(CONFIG, model=str(tmp_path / "model"), num_epochs=EPOCHS)
    return s, event_log.record(s._parts.events, [])


def test_session_train(tmp_path):
    s, seen = session(tmp_path)
    s.train()
    assert seen == loop(STEPS)


def test_a_mix_of_train_calls_steps_through_the_same_loop(tmp_path):
    s, seen = session(tmp_path)
    s.train_step()
    s.train_steps(3)
    s.train_epoch()  # the rest of epoch 1
    s.train_steps(STEPS)  # all of epoch 2's steps, not its end
    s.train()
    assert without_runs(seen) == without_runs(loop(STEPS))
    assert [k for k in seen if k[0] == "run_end"] == [("run_end", "done")] * 5  # one run per call
    assert seen.count(("run_begin",)) == 5


def test_train_async(tmp_path):
    s, seen = session(tmp_path)
    asyncio.run(s.train_async())
    assert seen == loop(STEPS)


def test_train_in_background(tmp_path):
    s, seen = session(tmp_path)
    s.train_in_background()
    s.wait()
    assert seen == loop(STEPS)


def test_cli(tmp_path):
    seen: list[tuple] = []
    with event_log.every_engine_recorded(seen):
        assert main(["-q", "train", str(CONFIG), f"model={tmp_path / 'model'}", f"num_epochs={EPOCHS}"]) == 0
    assert seen == loop(STEPS)


def test_a_pause_ends_the_run_as_paused_and_the_loop_continues(tmp_path):
    s, seen = session(tmp_path)
    s.on("step_end", lambda result, **_: s.pause() if result.step == 4 and result.epoch == 1 else None)
    assert s.train().paused
    assert seen[-2:] == [("interrupt",), ("run_end", "paused")]
    s.train()
    assert without_runs([k for k in seen if k != ("interrupt",)]) == without_runs(loop(STEPS))


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_torchrun_rank_0(tmp_path):
    import torch

    from kit.engine import distributed

    dump = tmp_path / "dump"
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               KIT_DDP_DUMP=str(dump))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kit",
           "train", str(CONFIG), f"model={tmp_path / 'model'}", f"num_epochs={EPOCHS}", "torch_distributed={}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    events = torch.load(f"{dump}.rank0.pt", weights_only=True)["events"]
    assert [tuple(k) for k in events] == loop(RANK_STEPS)


def test_the_expected_sequence_can_fail(tmp_path):
    """Negative control: one more or one less epoch, or steps of another count, is a different sequence."""
    s, seen = session(tmp_path)
    s.train()
    assert seen != loop(STEPS, EPOCHS + 1) and seen != loop(STEPS - 1) and seen != loop(RANK_STEPS)
