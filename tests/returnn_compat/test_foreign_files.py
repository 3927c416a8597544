"""kit never writes a file it did not write: every path through a RETURNN run directory leaves RETURNN's
files bitwise as they were (fallback past a damaged newest checkpoint, cleanup, resume, start_epoch)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kit import checkpoints
from kit.errors import CheckpointError
from tests.returnn_compat.test_run_dir import _session, make_returnn_run

RETURNN_FILES = ["model.001.pt", "model.002.pt", "model.002.opt.pt"]


def _digests(run_dir) -> dict[str, str]:
    """sha256 of every file in the run directory that kit did not create (the learning-rate file aside:
    kit keeps it in RETURNN's format, tested in test_run_dir.py)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.iterdir()) if p.name.startswith("model.0") and "manifest" not in p.name}


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_newest_returnn_checkpoint_stops_before_training(tmp_path):
    make_returnn_run(tmp_path)
    _truncate(tmp_path / "model.002.pt")
    before = _digests(tmp_path)
    with _session(tmp_path) as session, pytest.raises(CheckpointError) as err:
        session.train()
    assert "model.002.pt" in str(err.value) and "Move it away" in str(err.value)
    assert _digests(tmp_path) == before
    assert not (tmp_path / "model.002.manifest.json").exists()
    # what the message says to do works: move the damaged files away, and kit continues from model.001
    for name in ("model.002.pt", "model.002.opt.pt"):
        (tmp_path / name).rename(tmp_path / (name + ".bak"))
    kept = {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("model.001.pt",)}
    with _session(tmp_path) as session:
        session.train()
        assert session.progress.epoch == 4
    assert {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("model.001.pt",)} == kept


def test_damaged_newest_returnn_optimizer_file_is_not_replaced(tmp_path):
    """The model file loads, its .opt.pt is damaged: kit continues with a fresh optimizer and writes only epoch 3."""
    make_returnn_run(tmp_path)
    _truncate(tmp_path / "model.002.opt.pt")
    before = _digests(tmp_path)
    with _session(tmp_path) as session:
        session.train()
    after = _digests(tmp_path)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"model.003.pt", "model.003.opt.pt"}


@pytest.mark.parametrize("keep_last_n", [0, 1])
def test_cleanup_leaves_returnn_files_damaged_or_not(tmp_path, keep_last_n):
    make_returnn_run(tmp_path)
    torch.save({"model": {}, "epoch": 0}, tmp_path / "model.000.pt")  # an older RETURNN file, intact
    (tmp_path / "model.000.opt.pt").write_bytes(b"\x00garbage")  # and a damaged one
    before = _digests(tmp_path)
    with _session(tmp_path, num_epochs=4, cleanup_old_models={"keep_last_n": keep_last_n, "keep_best_n": 0}) as s:
        s.train()
    after = _digests(tmp_path)
    # RETURNN's rule removed its epoch-2 optimizer state when epoch 4 was saved (as RETURNN would);
    # everything else RETURNN wrote is as it was, the damaged file included
    assert "model.002.opt.pt" not in after
    del before["model.002.opt.pt"]
    assert {k: after[k] for k in before} == before


def test_cleanup_direct_call_keeps_damaged_foreign_files(tmp_path):
    make_returnn_run(tmp_path)
    _truncate(tmp_path / "model.001.pt")
    before = _digests(tmp_path)
    with _session(tmp_path) as session:
        session.train()
    checkpoints.cleanup(str(tmp_path / "model"), {"keep_last_n": 0, "keep_best_n": 0})
    after = _digests(tmp_path)
    assert {k: after[k] for k in before} == before


def test_start_epoch_over_returnn_files_fails_before_training(tmp_path):
    make_returnn_run(tmp_path)
    before = _digests(tmp_path)
    with _session(tmp_path, start_epoch=1, num_epochs=2) as session, pytest.raises(CheckpointError, match="model.001"):
        session.train()
    assert _digests(tmp_path) == before
    assert not list(tmp_path.glob("*.manifest.json"))


def test_save_refuses_a_damaged_foreign_file_without_manifest(tmp_path):
    """Negative control at the lowest level: a damaged model file without manifest is not kit's."""
    prefix = str(tmp_path / "model")
    (tmp_path / "model.001.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="not written by kit"):
        checkpoints.save(prefix, epoch=1, model_state={}, train_state={"progress": {}, "rng": {}}, global_train_step=0)
    # kit's own incomplete save (model file written, manifest not yet) is replaced
    (tmp_path / "model.001.pt").unlink()
    state = {"progress": {}, "rng": {}}
    checkpoints.save(prefix, epoch=1, model_state={}, train_state=state, global_train_step=0)
    (tmp_path / "model.001.manifest.json").unlink()
    checkpoints.save(prefix, epoch=1, model_state={}, train_state=state, global_train_step=0)
    assert (tmp_path / "model.001.manifest.json").is_file()
