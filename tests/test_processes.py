"""``session.train(processes=2)``: two spawned gloo workers from a Session (kit/multiproc/).

tests/helpers/procs_config.py trains 6 steps per rank and epoch. The schedule 2 processes, then 1
(in this process), then 2 must give bitwise the weights, optimizer state and scores of the same
schedule from the command line (torchrun, ``python -m kit train``, torchrun, each resuming from the
last one's checkpoint): every call runs the engine's own code with the same seeds, shards and
order of additions, and the state that comes home is what a checkpoint holds. A pause (Ctrl-C)
mid-epoch must continue exactly as the uninterrupted two-process epoch; a worker's error must
come back as the session's, with the worker's traceback and a replayable DebugContext.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import models

import kit
from kit import multiproc
from kit.engine import distributed

TESTS = Path(__file__).resolve().parent
CONFIG = TESTS / "helpers" / "procs_config.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return env


def _cli(tmp_path: Path, prefix: Path, epochs: int, processes: int) -> None:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)] if processes > 1 else []
    extra = ["torch_distributed={}"] if processes > 1 else []
    cmd = [sys.executable, *launcher, "-m", "kit", "train", str(CONFIG), f"model={prefix}", f"num_epochs={epochs}",
           *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"


def _session(prefix: Path, **overrides) -> kit.Session:
    return kit.Session.from_config(str(CONFIG), model=str(prefix), live=False, **overrides)


def _same_state(session: kit.Session, weights: dict, optimizer: dict) -> None:
    for name, tensor in session.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    mine = session.optimizer.state_dict()["state"]
    assert mine.keys() == optimizer["state"].keys()
    for key, slots in mine.items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer["state"][key][slot])), (key, slot)


def _scores(table) -> dict:
    return {e: table.scores(e) for e in table.epochs}


@pytest.fixture(autouse=True)
def _spawned_not_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fork would carry into the workers (as CUDA's state would): the config's train_step refuses it."""
    monkeypatch.setattr(models, "KERNEL_ONLY_MARK", True, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def cli_schedule(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict, dict, dict]]:
    """torchrun (2 ranks) for epoch 1, ``kit train`` (1 process) for epoch 2, torchrun for epoch 3, each resuming
    from the last one's checkpoint: epoch → (weights, optimizer state, scores) after it."""
    tmp_path = tmp_path_factory.mktemp("cli")
    prefix = tmp_path / "cli" / "model"
    out = {}
    for epochs, processes in ((1, 2), (2, 1), (3, 2)):
        _cli(tmp_path, prefix, epochs, processes)
        model_file = torch.load(f"{prefix}.{epochs:03d}.pt", weights_only=True)
        opt = torch.load(f"{prefix}.{epochs:03d}.opt.pt", weights_only=True)
        out[epochs] = (model_file["model"], opt["optimizer"], _scores(kit.ScoreTable.load(f"{prefix}.scores.json")))
    log = kit.attach(prefix)  # the event log, written by rank 0 alone (under torchrun the ranks poll together)
    log.refresh()
    assert [e["goal"] for e in log.events if e["event"] == "run_begin"] == ["train"] * 3 and log.status == "done"
    return out


def test_two_then_one_then_two_processes_equal_the_cli_schedule(tmp_path: Path, cli_schedule) -> None:
    session = _session(tmp_path / "s" / "model")
    with session:
        first = session.train_epoch(processes=2)
        assert first.outcome == "done" and (first.epoch, first.step) == (2, 0)
        assert first.global_train_step == 6  # each rank's steps: 12 batches / 2
        assert list(session.history["global_train_step"]) == list(range(6))  # rank 0's steps, relayed live
        assert set(multiproc.rank_status(session)) <= {0, 1}
        from kit.widgets.ranks import RankStrip

        assert "rank 0" in RankStrip(session).html()  # the per-rank strip
        from kit.widgets.dashboard import Dashboard

        board = Dashboard(session, mode="widget")  # the session's one dashboard shows the same strip
        assert board.ranks.widget.value == RankStrip(session).html() != ""
        board.detach()
        _same_state(session, *cli_schedule[1][:2])
        second = session.train_epoch(processes=1)  # in this process: all 12 batches
        assert second.global_train_step == 18
        _same_state(session, *cli_schedule[2][:2])
        third = session.train_epoch(processes=2)
        assert third.global_train_step == 24 and third.scores_epoch == 3
        weights, optimizer, scores = cli_schedule[3]
        _same_state(session, weights, optimizer)
        assert _scores(session.info().score_table) == scores
        assert (tmp_path / "s" / "model.003.pt").exists()  # rank 0 wrote the session's checkpoints


def test_ctrl_c_pauses_every_rank_at_one_step_and_the_epoch_continues_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_schedule) -> None:
    weights, optimizer, scores = cli_schedule[1]  # the uninterrupted two-process epoch
    monkeypatch.setenv("KIT_PROCS_STEP_SLEEP", "0.15")  # the workers read it when they start
    with _session(tmp_path / "p" / "model") as session:
        session.setup()

        def interrupt_once_training() -> None:
            while not any(s.step >= 1 for s in multiproc.rank_status(session).values()):
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)  # "interrupt kernel": the guard's handler sets the flag

        threading.Thread(target=interrupt_once_training, daemon=True).start()
        paused = session.train_epoch(processes=2)
        assert paused.outcome == "paused" and paused.reason == "interrupt"
        assert 1 <= paused.step < 6 and paused.epoch == 1
        assert session.progress.step_in_epoch == paused.step  # rank 0's state came home
        done = session.train_epoch()  # processes=None: the paused epoch goes on with its 2 workers
        assert done.outcome == "done" and done.global_train_step == 6
        _same_state(session, weights, optimizer)
        assert _scores(session.info().score_table) == scores
        assert list(session.history["global_train_step"]) == list(range(6))


def test_pause_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIT_PROCS_STEP_SLEEP", "0.15")
    with _session(tmp_path / "b" / "model") as session:
        session.train_in_background("epoch", processes=2)
        while not any(s.step >= 1 for s in multiproc.rank_status(session).values()):
            time.sleep(0.02)
        session.pause()
        result = session.wait()
        assert result.outcome == "paused" and result.mode == "background" and result.step < 6
        done = asyncio.run(session.train_epoch_async())  # the awaitable form goes on with the same workers
        assert done.outcome == "done" and done.mode == "awaitable" and done.global_train_step == 6
        pids = multiproc.worker_pids(session)
        assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)  # closed with the session


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent's wait() does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_worker_outlives_the_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "kernel.py"
    script.write_text(f"""
import kit
if __name__ == "__main__":
    session = kit.Session.from_config({str(CONFIG)!r}, model={str(tmp_path / 'model')!r}, live=False)
    session.train_steps(1, processes=2)
    print(*kit.multiproc.worker_pids(session))
    # no session.close(): the interpreter ends with the workers running
""")
    proc = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_a_worker_error_is_the_sessions_with_its_traceback_and_a_replayable_context(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIT_PROCS_FAIL_AT", "2")
    with _session(tmp_path / "f" / "model") as session:
        with pytest.raises(ValueError, match="planted failure at global step 2") as caught:
            session.train_epoch(processes=2)
        cause = caught.value.__cause__
        assert isinstance(cause, multiproc.RemoteTraceback)
        assert "train_step" in cause.text and "planted failure" in cause.text  # the worker's own frames
        assert "error" in session.status
        ctx = session.last_failure
        assert ctx is not None and ctx.event == "exception" and ctx.global_train_step == 2
        assert ctx.batch is not None and ctx.model is session.model
        report = session.replay(ctx)  # in this process, on the weights of the failing step
        assert report.error is not None and "planted failure" in report.error
        monkeypatch.delenv("KIT_PROCS_FAIL_AT")
        # the next call starts new workers from the state that came home; as after an error in this process, the
        # failing step's batches were taken (one per rank): the epoch goes on after them, 3 more steps per rank
        result = session.train_epoch(processes=2)
        assert result.outcome == "done" and result.global_train_step == 5


def test_attach_follows_a_cli_run_and_pauses_it(tmp_path: Path) -> None:
    prefix = tmp_path / "job" / "model"
    env = {**_env(), "KIT_PROCS_STEP_SLEEP": "0.1"}
    cmd = [sys.executable, "-m", "kit", "train", str(CONFIG), f"model={prefix}", "num_epochs=5", "log_every_n_steps=1"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = kit.attach(prefix)
        deadline = time.monotonic() + 120
        while len(run.history) < 14 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # past the first epoch's end: a score row, a checkpoint
        assert run.running, run.status
        assert list(run.scores.index) == [1] and "dev_loss_ce" in run.scores.columns
        assert run.checkpoints == ["model.001"]
        run.pause()
        assert run.wait(timeout=60).startswith("paused")
        assert job.wait(timeout=60) == 138, job.stderr.read() if job.stderr else ""  # as after SIGUSR1
    finally:
        if job.poll() is None:
            job.kill()
    stopped = next(e for e in run.events if e["event"] == "request")
    saved = run.events[-2]  # the step checkpoint, written after the stop, before the process' last line
    assert saved["event"] == "checkpoint" and saved["kind"] == "step"
    assert saved["global_train_step"] == stopped["global_train_step"] + 1  # the step it was in finished
    assert [e["global_train_step"] for e in run.events if e["event"] == "step"] == list(range(saved["global_train_step"]))
    assert not Path(f"{prefix}.request").exists()


def test_attach_pauses_a_torchrun_job_on_every_rank_at_one_step(tmp_path: Path) -> None:
    """Under torchrun the ranks read the request together (one all-reduce every DIST_POLL_STEPS steps): every
    rank finishes the same step, rank 0 writes the step checkpoint, each rank exits as after SIGUSR1, and the
    next torchrun run continues from that checkpoint to the end."""
    from kit.eventlog import DIST_POLL_STEPS

    prefix = tmp_path / "job" / "model"
    env = {**_env(), "KIT_PROCS_STEP_SLEEP": "0.05"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kit", "train",
           str(CONFIG), f"model={prefix}", "num_epochs=8", "log_every_n_steps=1", "torch_distributed={}"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = kit.attach(prefix)
        deadline = time.monotonic() + 120
        while len(run.history) < 8 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # past the first epoch (6 steps per rank)
        assert run.running, run.status
        run.pause()
        assert run.wait(timeout=120).startswith("paused")
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    out = (job.stdout.read() if job.stdout else "") + (job.stderr.read() if job.stderr else "")
    assert job.returncode != 0 and out.count("exitcode  : 138") == 2, out[-3000:]  # torchrun lists each rank's exit
    stopped = next(e for e in run.events if e["event"] == "request")
    assert stopped["global_train_step"] % DIST_POLL_STEPS == 0  # read at a poll step, by both ranks at once
    saved = run.events[-2]
    assert saved["event"] == "checkpoint" and saved["kind"] == "step"
    assert saved["global_train_step"] == stopped["global_train_step"] + 1 < 8 * 6  # mid-run, one step later
    assert [e["global_train_step"] for e in run.events if e["event"] == "step"] == list(range(saved["global_train_step"]))
    assert not Path(f"{prefix}.request").exists()
    _cli(tmp_path, prefix, 8, 2)  # torchrun again: continues from the step checkpoint
    run.refresh()
    assert run.status == "done" and [e["epoch"] for e in run.events if e["event"] == "epoch_end"][-1] == 8
    assert [e["kind"] for e in run.events if e["event"] == "checkpoint"][-1] == "epoch"


def test_what_processes_refuses_before_starting_workers(tmp_path: Path) -> None:
    with _session(tmp_path / "r" / "model") as session:
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match="processes must be an int >= 1"):
                session.train_steps(1, processes=bad)
        session.break_on(3)
        with pytest.raises(kit.SessionStateError, match="break points"):
            session.train_epoch(processes=2)
        assert multiproc.worker_pids(session) == []  # nothing was started
        session.break_on()
        assert session.train_steps(1, processes=1).global_train_step == 0  # its one step, in this process
