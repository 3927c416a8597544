"""Interrupt = pause at the step boundary: in-process SIGINTs, and a real Jupyter kernel.

The kernel tests run ``session.train()`` in a cell, send "interrupt kernel" after a random
delay (or while eval / a checkpoint save is in progress), check the cell returned normally
with "paused at epoch E, step S", continue in the next cell, and compare the final weights
and every step's losses with an uninterrupted run (``torch.equal``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import slow_writes
from helpers.models import tiny_config
from helpers.models import train_step as tiny_train_step
from session_testlib import LossRecorder, state, states_equal, write_config

import kit
import kit.fileio

# ---- in process -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["step", "eval", "save"])
def test_sigint_pauses_at_the_boundary_and_continuing_equals_an_uninterrupted_run(
    where, tmp_path, monkeypatch, reference
):
    sent = []

    def interrupt_once(now: bool) -> None:
        if now and not sent:
            sent.append(1)
            signal.raise_signal(signal.SIGINT)  # delivered to the main thread: the handler runs at once

    def train_step(*, model, extern_data, **kwargs):
        ctx = kit.get_run_ctx()
        interrupt_once(
            (where == "step" and ctx.train_flag and ctx.step == 7) or (where == "eval" and not ctx.train_flag)
        )
        tiny_train_step(model=model, extern_data=extern_data, **kwargs)

    if where == "save":  # inside a file write, after its data and before the rename
        real_open = kit.fileio.atomic_open

        @contextlib.contextmanager
        def interrupting_open(path, mode="wb"):
            with real_open(path, mode) as f:
                yield f
                interrupt_once(True)

        monkeypatch.setattr(kit.fileio, "atomic_open", interrupting_open)
    s = kit.Session(**tiny_config(str(tmp_path / "model"), train_step=train_step))
    rec = LossRecorder()
    s.on("step_end", rec)
    handler = signal.getsignal(signal.SIGINT)
    paused = s.train()
    assert sent and paused.paused and s.status == "paused"
    assert (paused.epoch, paused.step) == ((1, 8) if where == "step" else (2, 0))
    assert str(paused).startswith(f"paused at epoch {paused.epoch}, step {paused.step}")
    assert signal.getsignal(signal.SIGINT) is handler  # only held while training
    if where == "save":
        assert s.checkpoints.table["verified"].tolist() == [True]  # the save finished before the pause
    result = s.train()
    assert result == {k: v for k, v in reference["scores"].loc[3].items() if k in result}
    assert states_equal(state(s.model), reference["state"])
    assert torch.equal(rec.stacked(), reference["losses"].stacked())


def test_a_pause_inside_a_gradient_accumulation_window_continues_equal():
    def run(pause_at: int | None):
        s = kit.Session(**tiny_config(num_epochs=1, accum_grad_multiple_step=3))
        rec = LossRecorder()
        s.on("step_end", rec)
        if pause_at is not None:
            s.on(
                "step_end",
                lambda result, **_: (
                    result.global_train_step == pause_at and signal.raise_signal(signal.SIGINT)
                ),
            )
        first = s.train()
        if pause_at is not None:
            assert first.paused and s._parts.engine.progress.accum_count == (pause_at + 1) % 3 != 0
            s.train()
        return state(s.model), rec.stacked(), s.scores

    plain, paused = run(None), run(7)
    assert states_equal(paused[0], plain[0]) and torch.equal(paused[1], plain[1])
    assert paused[2].loc[1, "train_loss_ce"] == plain[2].loc[1, "train_loss_ce"]


def test_a_second_sigint_within_a_second_raises_and_the_session_asks_for_a_restore(tmp_path, reference):
    def kill() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def train_step(*, model, extern_data, **kwargs):
        if kit.get_run_ctx().step == 25 and not fired:
            fired.append(1)
            for delay in (0.05, 0.25):
                threading.Timer(delay, kill).start()
            time.sleep(2.0)  # a long step: both interrupts arrive inside it
        tiny_train_step(model=model, extern_data=extern_data, **kwargs)

    fired: list = []
    s = kit.Session(**tiny_config(str(tmp_path / "model"), train_step=train_step))
    s.train_epoch()
    with pytest.raises(KeyboardInterrupt):
        s.train()
    assert s.status == "error: interrupted mid-step"
    for call in (s.train_step, s.train_epoch, s.train, lambda: s.train_steps(2)):
        with pytest.raises(
            kit.SessionStateError,
            match=r"interrupted mid-step.*epoch 2, step 6.*restore\(.*reload_latest\(\)",
        ):
            call()
    s.reload_latest()  # the newest complete checkpoint: the end of epoch 1
    assert (s.epoch, s.step_in_epoch, s.global_train_step) == (2, 0, 19)
    s.train()
    assert states_equal(state(s.model), reference["state"])


# ---- a real Jupyter kernel --------------------------------------------------------------------

# the shared test config file (session_testlib.CONFIG_FILE) with more data, one more epoch and slow steps
KERNEL_CONFIG_EXTRA = """
import os, time
import kit
from helpers.models import train_step as _tiny_train_step

train = {"class": "Task12AXDataset", "num_seqs": 200, "seed": 1, "seq_ordering": "random"}
num_epochs = 4


def train_step(*, model, extern_data, **kwargs):
    # steps of a few ms, and (when asked) a slow eval: sleeping changes no number
    train_flag = kit.get_run_ctx().train_flag
    time.sleep(float(os.environ.get("STEP_SECS" if train_flag else "EVAL_STEP_SECS", "0")))
    _tiny_train_step(model=model, extern_data=extern_data, **kwargs)
"""

SETUP_CELL = """
import os, pathlib, time, torch, kit
torch.set_num_threads(1)

def touch_once(path):
    try:
        open(path, "x").close()
    except FileExistsError:
        pass
"""

SESSION_CELL = """
os.environ.update({env!r})
marks = pathlib.Path({marks!r})
session = kit.Session.from_config({config!r}, model={prefix!r})
losses = []
session.on("step_end", lambda result, **_: losses.append(result.step_losses.values.clone()))
session.on("step_end", lambda **_: touch_once(marks / "started"))
for event in ("eval_begin", "eval_end", "checkpoint_saved"):
    session.on(event, lambda _event=event, **_: touch_once(marks / _event))
session.setup()  # built here, not in the timed cell
"""

CONTINUE_CELL = """
for key in {env!r}:
    os.environ.pop(key)
print("continued:", session.train())
torch.save({{"state": session.model.state_dict(), "losses": torch.stack(losses)}}, {out!r})
session.close()
"""


class Kernel:
    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=120)

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def wait(self, msg_id: str, timeout: float = 120) -> tuple[str, str]:
        """(reply status, text output) of one cell."""
        out = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                out.append(f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"]))
            elif kind == "execute_result":
                out.append(content["data"].get("text/plain", ""))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        return reply["content"]["status"], "".join(out)

    def run(self, code: str) -> str:
        status, out = self.wait(self.send(code))
        assert status == "ok", out
        return out

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.run(SETUP_CELL)
    k.run(slow_writes.code(str(Path(__file__).resolve().parents[1])))  # KIT_TEST_SLOW_WRITE_SECS in the kernel
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def kernel_config(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("kernel") / "config.py", KERNEL_CONFIG_EXTRA)


@pytest.fixture(scope="module")
def uninterrupted(kernel_config, tmp_path_factory) -> dict:
    rec = LossRecorder()
    with kit.Session.from_config(kernel_config, model=str(tmp_path_factory.mktemp("plain") / "model")) as s:
        s.on("step_end", rec)
        s.train()
        result = {"state": state(s.model), "losses": rec.stacked()}
    return result


def wait_for(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never happened"
        time.sleep(0.002)


SCENARIOS = {
    # name: (env in the kernel, marker to wait for, delay range after it in seconds)
    "random-a": ({"STEP_SECS": "0.01"}, "started", (0.05, 0.8)),
    "random-b": ({"STEP_SECS": "0.01"}, "started", (0.05, 0.8)),
    "random-c": ({"STEP_SECS": "0.01"}, "started", (0.05, 0.8)),
    "during-eval": ({"EVAL_STEP_SECS": "0.15"}, "eval_begin", (0.02, 0.2)),
    "during-save": ({"KIT_TEST_SLOW_WRITE_SECS": "0.2"}, "eval_end", (0.3, 0.5)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kernel_interrupt_pauses_and_the_next_cell_continues_exactly(
    scenario, kernel, kernel_config, uninterrupted, tmp_path
):
    env, marker, (low, high) = SCENARIOS[scenario]
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "result.pt"
    kernel.run(
        SESSION_CELL.format(
            env=env, marks=str(marks), config=str(kernel_config), prefix=str(tmp_path / "model")
        )
    )
    delay = random.uniform(low, high)
    cell = kernel.send("print(session.train())")
    wait_for(marks / marker)
    time.sleep(delay)
    interrupted_at = time.time()
    kernel.km.interrupt_kernel()
    status, text = kernel.wait(cell)
    assert status == "ok", f"the cell did not return normally (delay {delay:.3f}s):\n{text}"
    assert "paused at epoch" in text and "train" in text, f"not paused (delay {delay:.3f}s): {text}"
    if scenario == "during-eval":  # the epoch end finished (eval, scores, checkpoint), then the pause
        assert "paused at epoch 2, step 0" in text and (marks / "eval_end").stat().st_mtime > interrupted_at
    if scenario == "during-save":
        assert "paused at epoch 2, step 0" in text
        assert (marks / "checkpoint_saved").stat().st_mtime > interrupted_at
    kernel.run(CONTINUE_CELL.format(env=list(env), out=str(out)))
    got = torch.load(out, weights_only=True)
    assert states_equal(got["state"], uninterrupted["state"]), f"weights differ (delay {delay:.3f}s, {text})"
    assert torch.equal(got["losses"], uninterrupted["losses"]), f"losses differ (delay {delay:.3f}s, {text})"
    ckpts = kit.checkpoints.list_checkpoints(str(tmp_path / "model"))
    assert [c.epoch for c in ckpts] == [1, 2, 3, 4] and all(kit.checkpoints.verify(c) or True for c in ckpts)


def test_kernel_close_drops_the_stored_traceback_and_frees_the_model(kernel, kernel_config, tmp_path):
    kernel.run(f"""
session = kit.Session.from_config({str(kernel_config)!r}, train_step=lambda **_: 1 / 0)
import weakref
session.setup()
model_ref = weakref.ref(session.model)
""")
    status, text = kernel.wait(kernel.send("session.train_step()"))
    assert status == "error" and "ZeroDivisionError" in text
    out = kernel.run("""
import gc, sys
print("stored:", sys.last_traceback is not None)
session.close(); gc.collect()
print("model alive:", model_ref() is not None, "stored:", sys.last_traceback is not None)
""")
    assert "stored: True" in out and "model alive: False stored: False" in out
