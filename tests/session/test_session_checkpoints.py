"""session.checkpoints: table, load vs restore, restore parity, compare, export."""

from __future__ import annotations

import copy
import math
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.models import TinyModel, optimizer_states_equal, tiny_config
from session_testlib import score_part, state, states_equal

import kit
from kit.data import Task12AXDataset, batches
from kit.engine import saving


def train_with_a_step_checkpoint(prefix: str) -> kit.Session:
    """3 epochs, plus a step checkpoint 3 steps into epoch 3."""
    s = kit.Session(**tiny_config(prefix))
    s.train_epoch()
    s.train_epoch()
    s.train_steps(3)
    s.save()
    s.train()
    return s


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trained")
    train_with_a_step_checkpoint(str(directory / "model")).close()
    return directory


@pytest.fixture
def trained(trained_dir, tmp_path):
    """A session resumed from a copy of ``trained_dir``'s files: at the end of epoch 3."""
    shutil.copytree(trained_dir, tmp_path / "run")
    prefix = str(tmp_path / "run" / "model")
    s = kit.Session(**tiny_config(prefix))
    yield s, prefix
    s.close()


def weights_of(prefix: str, epoch: int) -> dict[str, torch.Tensor]:
    return kit.checkpoints.load(f"{prefix}.{epoch:03d}.pt")["model"]


def test_table_shows_what_one_chooses_by_and_table_all_the_rest(trained):
    s, _ = trained
    t, full = s.checkpoints.table, s.checkpoints.table_all
    assert list(t.columns[:6]) == ["name", "kind", "epoch", "global_train_step", "complete", "verified"]
    assert {"train_loss_ce", "dev_loss_ce", "is_best_dev_loss_ce"} <= set(t.columns)
    assert not {"path", "size_mb", "time", "would_remove"} & set(t.columns)  # no cleanup_old_models set
    pd.testing.assert_frame_equal(t, full[list(t.columns)])


def test_table_lists_checkpoints_with_scores_verification_and_best_flags(trained):
    s, prefix = trained
    t = s.checkpoints.table_all
    assert list(t["name"]) == ["model.001", "model.002", "model.003.step00000041", "model.003"]
    assert list(t["kind"]) == ["epoch", "epoch", "step", "epoch"]
    assert list(t["epoch"]) == [1, 2, 3, 3] and list(t["global_train_step"]) == [19, 38, 41, 57]
    assert t["path"].iloc[0] == prefix + ".001.pt"
    for row in t.itertuples():
        assert (
            row.size_mb
            == round(
                kit.checkpoints.Checkpoint.__dict__["size"].fget(s.checkpoints.find(row.path)) / 2**20, 3
            )
            > 0
        )
        pd.Timestamp(row.time)  # a readable time
    assert t["complete"].all() and t["verified"].all() and not t["would_remove"].any()
    epochs = t[t.kind == "epoch"].set_index("epoch")
    scores = s.scores
    for key in ("train_loss_ce", "dev_loss_ce", "dev_loss_fer"):
        assert (epochs[key] == scores.loc[[1, 2, 3], key]).all()
        best = scores.loc[[1, 2, 3], key].min()
        assert list(t[f"is_best_{key}"]) == [v == best for v in t[key]]
    assert math.isnan(t.loc[2, "dev_loss_ce"]) and not t.loc[2, "is_best_dev_loss_ce"]


def test_table_flags_incomplete_and_damaged_files(trained):
    s, prefix = trained
    assert s.checkpoints.table["verified"].all()  # (and remembered)
    with open(prefix + ".001.pt", "r+b") as f:  # flip one byte in place: same size
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(prefix + ".002.manifest.json")
    t = s.checkpoints.table.set_index("name")
    assert (t.loc["model.001", "complete"], t.loc["model.001", "verified"]) == (True, False)
    assert (t.loc["model.002", "complete"], t.loc["model.002", "verified"]) == (False, False)
    with pytest.raises(kit.CorruptCheckpointError):
        s.checkpoints.load(1)
    with pytest.raises(kit.CorruptCheckpointError, match="incomplete"):
        s.checkpoints.restore(2)


def test_would_remove_previews_cleanup_old_models(trained):
    s, prefix = trained
    s.config.update(cleanup_old_models={"keep_last_n": 1, "keep_best_n": {"dev_loss_ce": 1}})
    t = s.checkpoints.table
    best = int(s.scores.loc[[1, 2, 3], "dev_loss_ce"].idxmin())
    expected = {f"model.{e:03d}" for e in (1, 2) if e != best} | {"model.003.step00000041"}
    assert set(t[t.would_remove]["name"]) == expected
    s.setup()
    engine = s.engine
    removed = saving.cleanup(s.config, engine.scores, engine.last_checkpoint)  # what the epoch end would do
    assert {c.name for c in removed} == expected
    assert {c.name for c in s.checkpoints.list()} == set(t[~t.would_remove]["name"])


def test_load_inspects_and_restore_rewinds(trained):
    s, prefix = trained
    s.setup()
    trained_state, optimizer_state = state(s.model), copy.deepcopy(s.optimizer.state_dict())
    scores = s.scores
    position = (s.epoch, s.step_in_epoch, s.global_train_step)
    s.checkpoints.load(1)
    assert states_equal(state(s.model), weights_of(prefix, 1))
    assert (s.epoch, s.step_in_epoch, s.global_train_step) == position
    reference_optimizer = torch.optim.Adam(s.model.parameters())
    reference_optimizer.load_state_dict(optimizer_state)
    assert optimizer_states_equal(s.optimizer, reference_optimizer)
    assert s.status.startswith("inspecting model.001")
    s.extend(4)
    with pytest.raises(kit.SessionStateError, match=r"model\.001 for inspection.*restore.*reload_latest"):
        s.train()
    s.eval()  # looking at the inspected weights does not write them into the score table
    pd.testing.assert_frame_equal(s.scores, scores)
    s.reload_latest()
    assert states_equal(state(s.model), trained_state) and s.status == "ready"
    s.checkpoints.load(2)
    s.checkpoints.restore(1)  # rewinds everything, whatever was loaded for a look
    assert (s.epoch, s.step_in_epoch, s.global_train_step) == (2, 0, 19)
    assert states_equal(state(s.model), weights_of(prefix, 1))
    assert list(s.scores.dropna(subset=["train_loss_ce"]).index) == [1]


def test_continuing_from_a_restore_equals_the_original_continuation(tmp_path, reference):
    s = train_with_a_step_checkpoint(str(tmp_path / "model"))
    assert states_equal(state(s.model), reference["state"])  # the fixture's run equals a plain train()
    s.checkpoints.restore(1)
    assert list(s.history.global_train_step) == list(range(19))  # the rewound steps are forgotten
    s.train()
    assert states_equal(state(s.model), reference["state"])
    pd.testing.assert_frame_equal(score_part(s.scores), score_part(reference["scores"]))
    pd.testing.assert_frame_equal(
        s.history[["global_train_step", "ce"]], reference["history"][["global_train_step", "ce"]]
    )
    s.checkpoints.restore("step:41")  # mid-epoch: data position, accumulated sums, RNG
    assert (s.epoch, s.step_in_epoch, s.global_train_step) == (3, 3, 41)
    s.train()
    assert states_equal(state(s.model), reference["state"])
    pd.testing.assert_frame_equal(score_part(s.scores), score_part(reference["scores"]))


def test_negative_controls_without_rng_or_data_position_the_continuation_differs(trained, reference):
    s, _ = trained
    s.checkpoints.restore("step:41")
    s._parts.world.rng = None  # (a negative control reaches inside) forget the restored RNG world: the caller's global state is used instead
    torch.manual_seed(1234)
    s.train()
    assert not states_equal(state(s.model), reference["state"])
    s.checkpoints.restore("step:41")
    s.engine._training.pipeline.set_epoch(3)  # forget the data position: epoch 3 from its first batch
    s.train()
    assert not states_equal(state(s.model), reference["state"])


def test_compare_numbers_match_a_hand_computation(trained):
    s, prefix = trained
    frame = s.checkpoints.compare(1, 2)
    a, b = weights_of(prefix, 1), weights_of(prefix, 2)
    assert list(frame.index) == list(a)
    for name in a:
        wa, wb = a[name].numpy().astype(np.float64), b[name].numpy().astype(np.float64)
        norm_a, norm_b = math.sqrt((wa**2).sum()), math.sqrt((wb**2).sum())
        diff = math.sqrt(((wb - wa) ** 2).sum())
        row = frame.loc[name]
        assert row["shape"] == tuple(a[name].shape)
        assert row.norm_a == pytest.approx(norm_a, rel=1e-12)
        assert row.norm_b == pytest.approx(norm_b, rel=1e-12)
        assert row.l2_diff == pytest.approx(diff, rel=1e-12) and diff > 0
        assert row.rel_change == pytest.approx(diff / norm_a, rel=1e-12)
    now = s.checkpoints.compare(3)  # against the current weights, which are epoch 3's
    assert (now.l2_diff == 0).all() and (now.rel_change == 0).all()


def test_compare_on_a_batch_gives_output_differences(trained):
    s, prefix = trained
    s.setup()
    dev = Task12AXDataset(12, seed=5)
    batch = next(iter(batches(dev, batch_size=2000, max_seqs=6, extern_data=dev.extern_data, train=False)))
    before = state(s.model)
    frame = s.checkpoints.compare(1, 3, batch=batch)
    assert states_equal(state(s.model), before)  # the live weights are back
    outs = []
    for epoch in (1, 3):
        model = TinyModel()
        model.load_state_dict(weights_of(prefix, epoch))
        with torch.no_grad():
            outs.append(model.eval()(batch["data"].tensor))
    lengths = batch["data"].lengths.tolist()
    expected = max(float((outs[0][i, :n] - outs[1][i, :n]).abs().max()) for i, n in enumerate(lengths))
    assert frame.attrs["outputs"]["logits"] == pytest.approx(expected, rel=1e-5) and expected > 0


def test_export_safetensors_holds_the_checkpoint_weights(trained):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    s, prefix = trained
    path = s.checkpoints.export_safetensors(2)
    assert path == prefix + ".002.safetensors"
    assert states_equal(safetensors_torch.load_file(path), weights_of(prefix, 2))
    assert states_equal(kit.checkpoints.load(path), weights_of(prefix, 2))
