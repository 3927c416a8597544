"""A stop signal at any instant of ``python -m kit train`` — during set-up, mid-epoch, at an epoch end and
checkpoint write, after the run finished; alone or SLURM's SIGUSR1-then-SIGTERM pair — ends with the
documented status, and the rerun of the same command ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from tests.test_cli_signals import CONFIG, final_state, kit_cmd, reference  # noqa: F401 - the fixture

INSTANTS = {  # what to wait for before signalling: (stream, line start)
    "set-up": ("stderr", "device:"),
    "mid-epoch": ("stderr", "ep 1 train, step 2,"),
    "epoch end": ("stderr", "finished epoch 1:"),
    "after the run": ("stdout", "finished epoch 2:"),
}


def _signal_at(proc, instant: str, signals: list[signal.Signals]) -> tuple[int, str]:
    stream_name, start = INSTANTS[instant]
    stream = getattr(proc, stream_name)
    seen = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = stream.readline()
        assert line, "".join(seen)[-2000:]
        seen.append(line)
        if line.startswith(start):
            break
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.3)
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            break  # it had already ended
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + out + err


@pytest.mark.parametrize("instant, signals, status", [
    ("set-up", [signal.SIGUSR1, signal.SIGTERM], 138),
    ("mid-epoch", [signal.SIGUSR1, signal.SIGTERM], 138),
    ("epoch end", [signal.SIGUSR1, signal.SIGTERM], 138),
    ("after the run", [signal.SIGUSR1, signal.SIGTERM], 0),
    ("set-up", [signal.SIGTERM], 143),
    ("after the run", [signal.SIGTERM], 0),
])
def test_a_stop_signal_at_any_instant_ends_as_documented_and_loses_nothing(
        tmp_path, reference, instant, signals, status):  # noqa: F811 - the imported fixture
    (tmp_path / "cfg.py").write_text(CONFIG)
    code, output = _signal_at(kit_cmd("train", "cfg.py", cwd=tmp_path, KIT_TEST_STEP_SLEEP="0.05"), instant, signals)
    assert code == status, output[-3000:]
    if status:
        assert "kit: stopped by" in output
    rerun = kit_cmd("train", "cfg.py", cwd=tmp_path)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-2000:]
    weights, optimizer, scores = final_state(tmp_path)
    ref_weights, ref_optimizer, ref_scores = final_state(Path(reference[0]))
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert scores == ref_scores
    assert not (tmp_path / "run" / "model.lock").exists()
