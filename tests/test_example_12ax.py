"""The 12AX example config (``kit.examples.path("12ax")``; ``examples/12ax.py`` in a clone) through
the command line, shortened: one epoch (of the example's five).

The full run (``python -m kit train examples/12ax.py``: 5 epochs on 1000 sequences) reaches
a dev frame error far below RETURNN's 0.02 bar; this shortened one must already beat the
majority-class baseline clearly, which only a model that learned the task's memory does.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import kit
import kit.examples
from kit.data import Task12AXDataset

ROOT = Path(kit.__file__).resolve().parents[1]
EXAMPLE = Path(kit.examples.path("12ax"))


def majority_frame_error(ds: Task12AXDataset) -> float:
    """Frame error of always predicting class 0 (the frequent one)."""
    labels = np.concatenate([ds.get_seq(i)["classes"] for i in range(len(ds))])
    return float(labels.mean())


def test_shortened_12ax_example_learns(tmp_path):
    prefix = tmp_path / "model"
    # 1000 sequences: with 800 the run sits at the edge of learning the memory, and whether it
    # does then depends on the exact order of one epoch
    train = "{'class': 'Task12AXDataset', 'num_seqs': 1000, 'seed': 1, 'seq_ordering': 'laplace:.10'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kit",
            "-q",
            "train",
            str(EXAMPLE),
            "num_epochs=1",
            f"model={prefix}",
            f"train={train}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    table = kit.ScoreTable.load(f"{prefix}.scores.json")
    assert table.epochs == [1]
    scores = table.scores(1)
    assert set(scores) == {"train_loss_ce", "train_loss_fer", "dev_loss_ce", "dev_loss_fer"}
    assert {"train_loss_fer", "dev_loss_fer"} == table.error_keys
    assert table.learning_rate(1) == 0.01
    assert all(math.isfinite(v) for v in scores.values())
    baseline = majority_frame_error(Task12AXDataset(100, seed=2))  # the example's dev set
    assert baseline > 0.1
    assert scores["dev_loss_fer"] < 0.6 * baseline, (scores, baseline)
    assert scores["dev_loss_ce"] < scores["train_loss_ce"]  # the epoch's mean includes the first steps
    assert Path(f"{prefix}.001.pt").is_file()
