"""``use_hot_reloading`` as RETURNN: a terminal asks after each step; a changed module is re-imported and the
step retried with the new code."""

from __future__ import annotations

import io
import os
import sys
import textwrap

import pytest

import kit

MODULE = """
import torch
import kit

def train_step(*, model, extern_data, **_):
    data, classes = extern_data["data"], extern_data["classes"]
    {body}
    logits = model(data.tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
    kit.get_run_ctx().mark_as_loss(ce, "ce", mask=classes.mask())
"""

CONFIG = """
import torch
from kit.data import Task12AXDataset
from {module} import train_step

def get_model(**_):
    return torch.nn.Linear(9, 2)

train = Task12AXDataset(20, seed=1)
extern_data = Task12AXDataset.extern_data
batch_size, optimizer, learning_rate, num_epochs = 300, {{"class": "adam"}}, 1e-2, 1
use_hot_reloading = True
"""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    name = f"hot_steps_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE.format(body='raise RuntimeError("not yet")')))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cfg.py").write_text(textwrap.dedent(CONFIG.format(module=name)))
    yield tmp_path, name
    sys.modules.pop(name, None)


def test_a_failing_step_is_retried_with_the_reloaded_module(user_code, monkeypatch):
    tmp_path, name = user_code
    monkeypatch.setattr(sys, "stdin", _Tty())
    prompts: list[str] = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        if len(prompts) == 1:  # the step raised: fix the module, reload, try again
            path = tmp_path / f"{name}.py"
            path.write_text(textwrap.dedent(MODULE.format(body="calls = 1")))
            os.utime(path, (os.path.getmtime(path) + 5, os.path.getmtime(path) + 5))  # a new mtime for sure
            return "r"
        return {2: "t"}.get(len(prompts), "c")

    monkeypatch.setattr("builtins.input", answer)
    session = kit.Session.from_config(tmp_path / "cfg.py")
    result = session.train_steps(2)
    assert result.global_train_step == 1 and session.progress.global_train_step == 2  # both ran (the first retried)
    assert "'t' to try again" in prompts[0] and "'d' to debug" in prompts[0]
    assert "'c' to continue" in prompts[2] and len(prompts) == 4  # after each finished step
    assert sys.modules[name].train_step is session.config.typed_value("train_step")  # the new function
    session.close()


def test_no_terminal_no_questions(user_code, monkeypatch):
    tmp_path, name = user_code
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE.format(body="calls = 1")))
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal: RETURNN does not hot reload either

    def no_input(prompt: str) -> str:
        raise AssertionError("asked without a terminal")

    monkeypatch.setattr("builtins.input", no_input)
    session = kit.Session.from_config(tmp_path / "cfg.py")
    assert session.train_steps(2).global_train_step == 1  # its last step
    session.close()
