"""A RETURNN run directory (files in RETURNN's formats, no kit manifest) continues in kit, undamaged.

The run is built here with torch.save in RETURNN's layouts, so these tests need no RETURNN;
tests/returnn_compat/test_round_trip.py does the same with files real RETURNN wrote.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
import torch

import kit
from kit.errors import CheckpointError
from kit.scores import parse_returnn_lr_file

LR_FILE = """{
1: EpochData(learningRate=0.01, error={
'dev_loss_ce': 0.69,
'train_loss_ce': 0.7,
':meta:global_train_step': 0,
}),
2: EpochData(learningRate=0.01, error={
'dev_loss_ce': 0.7,
'train_loss_ce': 0.65,
':meta:global_train_step': 6,
}),
}
"""


def _model() -> torch.nn.Module:
    return torch.nn.Linear(9, 2)


def get_model(**_):
    return _model()


def train_step(*, model, extern_data, **_):
    x, y = extern_data["data"], extern_data["classes"]
    logits = model(x.tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.tensor, reduction="none")
    kit.get_run_ctx().mark_as_loss(ce, "ce", mask=y.mask())


def _data(n: int, seed: int) -> kit.data.ArrayDataset:
    rng = np.random.RandomState(seed)
    seqs = []
    for _ in range(n):
        x = rng.uniform(-1, 1, size=(int(rng.randint(3, 8)), 9)).astype("float32")
        seqs.append({"data": x, "classes": (x[:, 0] > 0).astype("int64")})
    return kit.data.ArrayDataset(seqs)


def make_returnn_run(run_dir) -> dict[str, torch.Tensor]:
    """Epochs 1-2 as RETURNN leaves them: model.00N.pt, model.002.opt.pt, learning_rates."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in (1, 2):
        model(torch.randn(4, 9)).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.save({"model": model.state_dict(), "epoch": epoch, "step": 6 * epoch, "effective_learning_rate": 0.01,
                    "returnn_version": "1.20261022"}, run_dir / f"model.{epoch:03d}.pt")
    torch.save({"optimizer": opt.state_dict(), "optimizer_class_name": "Adam", "param_names": ["weight", "bias"],
                "epoch": 2, "step": 12, "effective_learning_rate": 0.01, "returnn_version": "1.20261022"},
               run_dir / "model.002.opt.pt")
    (run_dir / "learning_rates").write_text(LR_FILE)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _session(run_dir, **overrides) -> kit.Session:
    keys = dict(get_model=get_model, train_step=train_step, train=_data(12, 1), dev=_data(4, 2),
                extern_data={"data": {"dim": 9}, "classes": {"dim": 2, "sparse": True}},
                batch_size=40, max_seqs=4, optimizer={"class": "adam"}, learning_rate=0.01,
                model=str(run_dir / "model"), learning_rate_file=str(run_dir / "learning_rates"),
                num_epochs=3, learning_rate_control="newbob", newbob_relative_error_threshold=0.0,
                cleanup_old_models={"keep_last_n": 1, "keep_best_n": 0})
    keys.update(overrides)
    return kit.Session(**keys)


def _digests(run_dir, names) -> dict[str, str]:
    return {n: hashlib.sha256((run_dir / n).read_bytes()).hexdigest() for n in names}


def test_continues_returnns_newest_epoch_with_its_optimizer_state(tmp_path, caplog):
    weights = make_returnn_run(tmp_path)
    returnn_files = ["model.001.pt", "model.002.pt", "model.002.opt.pt"]
    before = _digests(tmp_path, returnn_files)
    with caplog.at_level(logging.INFO, logger="kit"), _session(tmp_path) as session:
        session._parts.engine.setup()
        assert (session.epoch, session.global_train_step) == (3, 12)
        for name, value in session._parts.engine.model.state_dict().items():
            assert torch.equal(value, weights[name]), name
        saved = torch.load(tmp_path / "model.002.opt.pt", weights_only=True)["optimizer"]
        loaded = session._parts.engine.optimizer.state_dict()
        assert loaded["state"].keys() == saved["state"].keys() == {0, 1}
        for i in (0, 1):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded["state"][i][key], saved["state"][i][key])
        session.train()
        assert session.epoch == 4
    assert "Skipping" not in caplog.text and "incomplete" not in caplog.text
    assert "continuing RETURNN's run" in caplog.text
    assert _digests(tmp_path, returnn_files) == before  # cleanup_old_models left RETURNN's files alone
    text = (tmp_path / "learning_rates").read_text()
    epochs = parse_returnn_lr_file(text)["epochs"]
    assert sorted(epochs) == [1, 2, 3]
    assert epochs[1]["scores"] == {"dev_loss_ce": 0.69, "train_loss_ce": 0.7}  # RETURNN's rows kept as they were
    assert epochs[3]["learning_rate"] == 0.005  # newbob on RETURNN's scores: dev got worse, lr halved
    assert set(epochs[3]["scores"]) == {"train_loss_ce", "dev_loss_ce"}
    # only the files RETURNN leaves: no manifest, no JSON score table, no lock
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "learning_rates", "model.001.pt", "model.002.opt.pt", "model.002.pt", "model.003.opt.pt", "model.003.pt"]


def test_kit_leaves_the_optimizer_states_returnn_leaves(tmp_path):
    make_returnn_run(tmp_path)
    (tmp_path / "model.001.opt.pt").write_bytes(b"not an optimizer state")  # not RETURNN's format: stays
    returnn_files = ["model.001.pt", "model.002.pt", "model.001.opt.pt"]
    before = _digests(tmp_path, returnn_files)
    with _session(tmp_path, num_epochs=5, cleanup_old_models={"keep_last_n": 5, "keep_best_n": 0}) as session:
        session.train()
    opt_files = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".opt.pt"))
    # RETURNN keeps the optimizer states of the last two epochs: its own epoch-2 state goes after kit's epoch 4,
    # kit's epoch-3 state after epoch 5, as RETURNN alone would have done
    assert opt_files == ["model.001.opt.pt", "model.004.opt.pt", "model.005.opt.pt"]
    assert _digests(tmp_path, returnn_files) == before


def test_kit_keeps_every_optimizer_state_with_run_files_kit(tmp_path):
    """Negative control: run_files='kit' keeps kit's own layout (manifests, JSON table, every state)."""
    make_returnn_run(tmp_path)
    with _session(tmp_path, num_epochs=4, run_files="kit", cleanup_old_models={"keep_last_n": 5, "keep_best_n": 0}) as session:
        session.train()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert {"model.002.opt.pt", "model.003.opt.pt", "model.004.opt.pt", "model.003.manifest.json",
            "learning_rates.kit.json"} <= set(names)


def test_refuses_to_overwrite_a_returnn_checkpoint(tmp_path):
    make_returnn_run(tmp_path)
    before = _digests(tmp_path, ["model.001.pt"])
    with _session(tmp_path, start_epoch=1, num_epochs=1) as session, pytest.raises(CheckpointError, match="not written by kit"):
        session.train()
    assert _digests(tmp_path, ["model.001.pt"]) == before
