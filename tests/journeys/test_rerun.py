"""Journeys: what the README tells a user to do, then what users do next — run it again in the same place.

Each runs in a fresh temporary folder, as a user would (a subprocess: exit code, the lines printed,
the files left). Re-running is always safe: it continues, or says there is nothing left to train
and returns — never a traceback.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.models import tiny_config

import kit

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def readme_block(section: str) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    text = readme.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def files_under(folder: Path) -> dict[str, int]:
    """Files and their modification times (the prefix lock, which every run takes, aside)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and p.suffix != ".lock"}


def test_the_quick_start_twice_in_the_same_folder(tmp_path) -> None:
    code = readme_block("Quick start")
    assert 'model="runs/demo/model"' in code and "num_epochs=3" in code
    (tmp_path / "quickstart.py").write_text(code.replace("num_epochs=3", "num_epochs=1"), encoding="utf-8")
    first = run([sys.executable, "quickstart.py"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "finished epoch 1" in first.stderr and "dev_loss_fer" in first.stdout
    after_first = files_under(tmp_path)
    assert {"runs/demo/model.001.pt", "runs/demo/model.scores.json"} <= set(after_first)

    second = run([sys.executable, "quickstart.py"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]  # the README: "resumes ... with nothing left to train"
    assert "Traceback" not in second.stderr
    assert "starting from runs/demo/model.001.pt (resume)" in second.stderr
    assert "nothing left to train" in second.stderr
    assert second.stdout == first.stdout  # the same score table, printed again
    assert files_under(tmp_path) == after_first  # nothing trained, nothing rewritten


def test_the_demo_training_twice(tmp_path) -> None:
    """``python -m kit train examples/12ax.py`` (README), again in the same folder: nothing to do, exit 0."""
    config = str(ROOT / "examples" / "12ax.py")
    small = ["num_epochs=1", "train={'class': 'Task12AXDataset', 'num_seqs': 100, 'seed': 1}"]
    first = run([sys.executable, "-m", "kit", "train", config, *small], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout.splitlines()
    assert out[0].startswith("finished epoch 1: train_loss_ce ")
    assert out[1].startswith("trained epoch 1 (1 this run, 1 in all) in ")
    assert re.fullmatch(r"best dev_loss_fer \S+ at epoch 1", out[2])
    assert out[3] == "files: runs/12ax/model.*.pt (checkpoints), runs/12ax/model.scores.json (scores)"
    assert "e+00" not in first.stdout + first.stderr
    left = files_under(tmp_path)

    second = run([sys.executable, "-m", "kit", "train", config, *small], tmp_path)
    assert second.returncode == 0 and "Traceback" not in second.stderr
    assert "nothing to do" in second.stdout
    assert files_under(tmp_path) == left

    more = run([sys.executable, "-m", "kit", "train", config, *small[1:], "num_epochs=2"], tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]  # a run continued from the command line
    assert "trained epoch 2 (1 this run, 2 in all)" in more.stdout
    scores = run([sys.executable, "-m", "kit", "scores", "runs/12ax"], tmp_path)
    assert scores.returncode == 0 and scores.stdout.startswith("runs/12ax/model.scores.json (2 epochs)")


def test_every_train_call_on_a_trained_session_says_so_and_returns(tmp_path) -> None:
    config = tiny_config(model=str(tmp_path / "model"), num_epochs=1)
    kit.Session(config).train()
    session = kit.Session(config)  # as after a kernel restart: resumes, nothing left
    results = [session.train_step(), session.train_steps(5), session.train_epoch(), session.train()]
    results += [asyncio.run(session.train_async()), asyncio.run(session.train_epoch_async()),
                asyncio.run(session.train_steps_async(3))]
    session.train_in_background()
    results.append(session.wait(timeout=60))
    for result in results:
        assert result.outcome == "finished", result
        assert "nothing left to train" in result.summary()
        assert result.epoch == 2 and result.last_step is None  # no step ran
    assert session.progress.epoch == 2 and session.status.kind is kit.session.Status.FINISHED
    session.extend(2)  # what the message says to do
    assert session.train().outcome == "finished" and list(session.scores.index) == [1, 2]
