"""Real RETURNN and kit on the same run directory: RETURNN trains epochs 1-2, kit 3, RETURNN 4.

The reference is RETURNN training epochs 1-4 alone. Per-step losses, the learning-rate file's
learning rates and scores, and the final weights must be equal to the last bit; kit must leave
every file RETURNN wrote as it was.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from kit.scores import parse_returnn_lr_file
from tests.returnn_compat.returnn_helpers import FIXTURES, needs_returnn, run_python

CONFIG = str(FIXTURES / "shared_run.config")


def _returnn(run_dir: Path, *extra: str) -> None:
    run_python(["-m", "returnn", CONFIG, *extra], env={"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps")})


def _kit(run_dir: Path, *extra: str) -> str:
    proc = run_python(["-m", "kit", "train", CONFIG, *extra],
                      env={"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps")})
    return proc.stdout + proc.stderr


def _lr_file(run_dir: Path) -> dict:
    return parse_returnn_lr_file((run_dir / "learning_rates").read_text())["epochs"]


def _digests(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.iterdir() if p.name != "steps"}


@needs_returnn
def test_returnn_kit_returnn_round_trip_equals_returnn_alone(tmp_path):
    alone, mixed = tmp_path / "alone", tmp_path / "mixed"
    alone.mkdir(), mixed.mkdir()
    _returnn(alone)
    _returnn(mixed, "++num_epochs", "2")
    written_by_returnn = _digests(mixed)
    log = _kit(mixed, "num_epochs=3")
    assert "continuing RETURNN's run" in log and "model.002.pt" in log
    after_kit = _digests(mixed)
    # kit rewrote only the learning-rate file (in RETURNN's format) and removed, by RETURNN's rule, the optimizer
    # state of epoch 1 (RETURNN removes epoch N-2's when it saves epoch N)
    assert set(written_by_returnn) - set(after_kit) == {"model.001.opt.pt"}
    for name, digest in written_by_returnn.items():
        if name not in ("learning_rates", "model.001.opt.pt"):
            assert after_kit[name] == digest, f"kit changed {name}, a file RETURNN wrote"
    _returnn(mixed)  # RETURNN continues from kit's epoch 3

    # kit left only what RETURNN leaves: the same files as RETURNN alone (RETURNN's epoch-1 optimizer state
    # removed by RETURNN's rule when kit saved epoch 3; no manifest, JSON table, event log or lock)
    assert sorted(p.name for p in mixed.iterdir()) == sorted(p.name for p in alone.iterdir())

    assert (alone / "steps").read_text() == (mixed / "steps").read_text()  # every step's loss, as repr
    want, got = _lr_file(alone), _lr_file(mixed)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for epoch in want:
        assert got[epoch]["learning_rate"] == want[epoch]["learning_rate"], epoch
        assert got[epoch]["scores"] == want[epoch]["scores"], epoch
        assert not any(math.isnan(v) for v in got[epoch]["scores"].values())
    final_alone = torch.load(alone / "model.004.pt", weights_only=True)["model"]
    final_mixed = torch.load(mixed / "model.004.pt", weights_only=True)["model"]
    assert final_alone.keys() == final_mixed.keys()
    for key in final_alone:
        assert torch.equal(final_alone[key], final_mixed[key]), key


@needs_returnn
def test_kit_without_returnns_optimizer_state_diverges(tmp_path):
    """Negative control: without RETURNN's .opt.pt (a fresh Adam), kit's epoch 3 is not RETURNN's."""
    alone, mixed = tmp_path / "alone", tmp_path / "mixed"
    alone.mkdir(), mixed.mkdir()
    _returnn(alone, "++num_epochs", "3")
    _returnn(mixed, "++num_epochs", "2")
    (mixed / "model.002.opt.pt").rename(tmp_path / "moved.opt.pt")
    log = _kit(mixed, "num_epochs=3")
    assert "fresh optimizer" in log
    assert _lr_file(alone)[3]["scores"] != _lr_file(mixed)[3]["scores"]


VARIANTS = ["seq_len", "dynamic_lr", "weight_decay", "lr_multiplier", "lr_patterns", "bf16", "float64", "clip_sgd", "clip_adamw", "callable_batch_size"]


@needs_returnn
@pytest.mark.parametrize("variant", VARIANTS)
def test_kit_equals_returnn(tmp_path, variant):
    """Two epochs of the same config under RETURNN and under kit: every step's loss, the
    learning-rate file and the final weights are equal to the last bit."""
    results = {}
    for runner in ("returnn", "kit"):
        run_dir = tmp_path / runner
        run_dir.mkdir()
        env = {"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps"), "VARIANT": variant}
        if runner == "returnn":
            run_python(["-m", "returnn", CONFIG, "++num_epochs", "2"], env=env)
        else:
            run_python(["-m", "kit", "train", CONFIG, "num_epochs=2"], env=env)
        results[runner] = ((run_dir / "steps").read_text(), _lr_file(run_dir),
                           torch.load(run_dir / "model.002.pt", weights_only=True)["model"])
    (steps_r, lrs_r, weights_r), (steps_k, lrs_k, weights_k) = results["returnn"], results["kit"]
    assert steps_k == steps_r and len(steps_r.splitlines()) > 4
    for epoch in (1, 2):
        assert lrs_k[epoch]["learning_rate"] == lrs_r[epoch]["learning_rate"]
        assert lrs_k[epoch]["scores"] == lrs_r[epoch]["scores"]
    assert weights_k.keys() == weights_r.keys()
    assert all(torch.equal(weights_k[k], weights_r[k]) for k in weights_r)
