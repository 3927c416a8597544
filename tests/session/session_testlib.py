"""Shared pieces of the Session tests: a config file, a plain reference run, comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import torch

import kit

TESTS_DIR = Path(__file__).resolve().parent.parent

# tiny_config() of tests/helpers/models.py as a RETURNN-style config file, datasets as dicts
CONFIG_FILE = """\
import sys
sys.path.insert(0, {tests_dir!r})
from helpers.models import get_model, train_step, forward_step

extern_data = {{"data": {{"shape": (None, 9)}}, "classes": {{"shape": (None,), "sparse_dim": 2}}}}
train = {{"class": "Task12AXDataset", "num_seqs": 120, "seed": 1, "seq_ordering": "random", "random_seed_offset": 8}}  # as tiny_config
dev = {{"class": "Task12AXDataset", "num_seqs": 30, "seed": 2}}
batch_size = 600
max_seqs = 10
optimizer = {{"class": "adam"}}
learning_rate = 0.01
num_epochs = 3
log_every_n_steps = 1000
{extra}
"""


def write_config(path: Path, extra: str = "") -> Path:
    path.write_text(CONFIG_FILE.format(tests_dir=str(TESTS_DIR), extra=extra))
    return path


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def score_part(frame: pd.DataFrame) -> pd.DataFrame:
    """The learning rate and score columns of a score frame (meta such as times differ per run)."""
    cols = [c for c in frame.columns if c == "learning_rate" or "_loss_" in c]
    return frame[cols]


class LossRecorder:
    """A ``step_end`` subscriber keeping each step's (global step, loss values) exactly."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, result: Any, **_: Any) -> None:
        self.steps.append(result.global_train_step)
        self.values.append(result.step_losses.values.detach().clone())

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.values)


def plain_run(prefix: str | None = None, **overrides: Any) -> dict[str, Any]:
    """``Session(...).train()`` start to end: final weights, per-step losses, scores, history."""
    from helpers.models import tiny_config

    rec = LossRecorder()
    with kit.Session(**tiny_config(prefix, **overrides)) as s:
        s.on("step_end", rec)
        s.train()
        return {
            "state": state(s.model),
            "losses": rec,
            "scores": s.scores,
            "history": s.history,
            "global_train_step": s.global_train_step,
            "epoch": s.epoch,
        }
