"""``session.lr_find()``: a sweep that stops at divergence and leaves the session bitwise as it was."""

from __future__ import annotations

import copy
import math
import time

import pandas as pd
import pytest
import torch

import kit
import kit.lr_finder
from kit import checkpoints
from tests.helpers.models import TinyModel, tiny_config


class CountingModel(TinyModel):
    """TinyModel with a buffer that training changes (as BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(x.detach().mean((0, 1)))
        return super().forward(x)


def get_model(**_: object) -> torch.nn.Module:
    return CountingModel()


def _session(tmp_path, name: str) -> kit.Session:
    return kit.Session(**tiny_config(str(tmp_path / name / "model"), get_model=get_model, num_epochs=2))


def _tensors_equal(a: object, b: object) -> bool:
    """Nested dicts/lists of tensors and plain values, compared with torch.equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_tensors_equal, a, b))
    return a == b or (a != a and b != b)


def _everything(session: kit.Session) -> dict:
    """What lr_find must not change: weights and buffers, grads, and the whole training state a
    step checkpoint holds (optimizer, progress, data position, loss sums, RNG states, LR), history, scores."""
    ckpt = session.save()
    _, train_state = checkpoints.load_checkpoint(ckpt)
    train_state.pop("scores")  # JSON text of the table: compared as a frame below
    return {
        "weights": {k: v.detach().clone() for k, v in session.model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in session.model.named_parameters()},
        "optimizer": copy.deepcopy(session.optimizer.state_dict()),
        "train_state": train_state,
        "history": session.history,
        "scores": session.score_table.to_pandas(),
        "caller_rng": torch.get_rng_state(),
    }


def _assert_same(before: dict, after: dict) -> None:
    for key in ("weights", "grads", "optimizer", "caller_rng"):
        assert _tensors_equal(before[key], after[key]), key
    for key, value in before["train_state"].items():
        assert _tensors_equal(value, after["train_state"][key]), f"train state: {key}"
    pd.testing.assert_frame_equal(before["history"], after["history"])
    pd.testing.assert_frame_equal(before["scores"], after["scores"])


def test_mid_epoch_sweep_leaves_everything_bitwise_and_training_continues_identically(tmp_path):
    reference = _session(tmp_path, "reference")
    reference.train_steps(5)
    session = _session(tmp_path, "swept")
    session.train_steps(5)
    before = _everything(session)
    result = session.lr_find(start_lr=1e-5, end_lr=1.0, num_steps=15)
    assert list(result.columns) == ["lr", "loss", "smoothed_loss"] and len(result) == 15
    assert result["lr"].iloc[0] == pytest.approx(1e-5) and result["lr"].iloc[-1] == pytest.approx(1.0)
    assert 1e-5 <= result.suggestion <= 1.0
    assert result["loss"].nunique() > 1  # the weights did move during the sweep
    _assert_same(before, _everything(session))
    assert session.model.seen.abs().sum() > 0  # the buffer is one that training changes
    # the strongest check: what comes next is exactly what would have come
    reference.train()
    session.train()
    for (k, a), b in zip(reference.model.state_dict().items(), session.model.state_dict().values()):
        assert torch.equal(a, b), k
    pd.testing.assert_frame_equal(reference.score_table.to_pandas()[["learning_rate", "dev_loss_ce"]],
                                  session.score_table.to_pandas()[["learning_rate", "dev_loss_ce"]])
    reference.close()
    session.close()


def test_negative_control_without_putting_the_state_back_the_checks_fail(tmp_path, monkeypatch):
    session = _session(tmp_path, "control")
    session.train_steps(5)
    before = _everything(session)
    from kit.engine.engine import Engine

    monkeypatch.setattr(Engine, "restore_state", lambda self, state, announce=True: None)
    session.lr_find(start_lr=1e-5, end_lr=1.0, num_steps=5)
    after = _everything(session)
    assert not _tensors_equal(before["train_state"]["progress"], after["train_state"]["progress"])
    assert not _tensors_equal(before["train_state"]["rng"], after["train_state"]["rng"])
    assert not _tensors_equal(before["optimizer"], after["optimizer"])
    session.close()


def test_at_an_epoch_start_and_with_the_data_running_out(tmp_path):
    session = _session(tmp_path, "start")
    reference = _session(tmp_path, "ref")
    steps = reference.train_epoch() and reference.score_table.meta(1)["epoch_num_train_steps"]
    result = session.lr_find(start_lr=1e-4, end_lr=1e-2, num_steps=steps + 4)  # more steps than one epoch has
    assert len(result) == steps + 4
    assert session.global_train_step == 0 and len(session.history) == 0
    session.train_epoch()
    assert all(torch.equal(a, b) for a, b in zip(reference.model.state_dict().values(),
                                                 session.model.state_dict().values()))
    reference.close()
    session.close()


def test_stops_early_when_the_loss_diverges(tmp_path):
    session = _session(tmp_path, "diverge")
    result = session.lr_find(start_lr=1e-3, end_lr=1e6, num_steps=40)
    assert len(result) < 40
    assert "diverged" in result.reason or "non-finite" in result.reason
    assert result.suggestion < 1e3
    assert "suggested learning rate" in repr(result)
    fig = result.plot()
    assert fig.axes[0].get_xscale() == "log"
    assert "<img" in result._repr_html_()
    session.close()


def test_refuses_during_a_background_run(tmp_path):
    session = kit.Session(**tiny_config(str(tmp_path / "bg" / "model"), num_epochs=50))
    session.train_steps(1)
    session.train_in_background()
    try:
        deadline = time.monotonic() + 10
        while not session.is_training and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(kit.SessionStateError, match="background"):
            session.lr_find(num_steps=5)
    finally:
        session.pause()
        session.wait()
        session.close()


@pytest.mark.parametrize("kwargs", [{"start_lr": 0}, {"start_lr": 1.0, "end_lr": 0.5}, {"num_steps": 1}])
def test_bad_arguments(tmp_path, kwargs):
    session = kit.Session(**tiny_config())
    with pytest.raises(ValueError, match="lr_find"):
        session.lr_find(**kwargs)
    assert math.isfinite(session.learning_rate)
