"""Hot edits: re-running the cell that defines train_step or the model's class changes the next train call's
code, keeps the session's state, and the history and score meta say which code trained which steps."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

import kit
from kit.data import Task12AXDataset

CELL_MODEL = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(9, 2)

    def forward(self, x):
        return self.lin(x){scale}
"""

CELL_STEP = """
import torch
import kit

def train_step(*, model, extern_data, **_):
    calls.append("{tag}")
    data, classes = extern_data["data"], extern_data["classes"]
    logits = model(data.tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
    kit.get_run_ctx().mark_as_loss(ce, "ce", mask=classes.mask())
"""


@pytest.fixture
def notebook():
    """A module standing in for a notebook's ``__main__``: cells run in its namespace."""
    mod = types.ModuleType("kit_test_notebook")
    mod.calls = []
    sys.modules[mod.__name__] = mod

    def run_cell(source: str) -> None:
        exec(compile(textwrap.dedent(source), "<cell>", "exec"), mod.__dict__)  # noqa: S102

    yield mod, run_cell
    del sys.modules[mod.__name__]


def test_rerun_cells_change_the_code_and_keep_the_state(notebook, tmp_path):
    mod, cell = notebook
    cell(CELL_MODEL.format(scale=""))
    cell(CELL_STEP.format(tag="v1"))
    session = kit.Session(get_model=lambda **_: mod.Net(), train_step=mod.train_step, train=Task12AXDataset(40, seed=1),
                          dev=Task12AXDataset(8, seed=2), extern_data=Task12AXDataset.extern_data, batch_size=300,
                          optimizer={"class": "adam"}, learning_rate=1e-2, num_epochs=1, model=str(tmp_path / "m"))
    session.train_steps(2)
    weight, optimizer = session.model.lin.weight, session.optimizer
    before = weight.detach().clone()
    cell(CELL_STEP.format(tag="v2"))  # the cells run again, the second with a change
    cell(CELL_MODEL.format(scale=" * 2.0"))
    session.train_steps(2)
    assert mod.calls == ["v1", "v1", "v2", "v2"]  # the new train_step from the next call on
    assert type(session.model) is mod.Net and session.model.lin.weight is weight  # new class, same parameters
    assert session.optimizer is optimizer and session.progress.global_train_step == 4
    assert not bool((weight.detach() == before).all())  # and the training went on from them
    with_new = session.model(torch_ones := __import__("torch").ones(1, 1, 9))
    assert bool((with_new == 2.0 * session.model.lin(torch_ones)).all())  # the new forward
    result = session.train_epoch()
    history = session.history
    versions = history["code_version"].tolist()
    assert versions[0] == versions[1] != versions[2] == versions[3]
    meta = session.scores_meta
    assert meta["code_version"].iloc[0] == f"{versions[0]},{versions[2]}"
    assert result.outcome in ("done", "finished")
    session.close()


def test_unchanged_cells_keep_one_version(notebook, tmp_path):
    mod, cell = notebook
    cell(CELL_MODEL.format(scale=""))
    cell(CELL_STEP.format(tag="v1"))
    session = kit.Session(get_model=lambda **_: mod.Net(), train_step=mod.train_step, train=Task12AXDataset(20, seed=1),
                          extern_data=Task12AXDataset.extern_data, batch_size=300, optimizer={"class": "adam"},
                          learning_rate=1e-2, num_epochs=1)
    session.train_steps(1)
    cell(CELL_STEP.format(tag="v1"))  # the same source run again: a new object, the same code version
    session.train_steps(1)
    assert session.history["code_version"].nunique() == 1
    assert mod.calls == ["v1", "v1"]
    session.close()
