"""Checkpoint browser widget without a browser: table, states, details, buttons, delete confirmation."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.faults import flip_byte
from helpers.models import tiny_config

import kit
from kit.widgets import CheckpointWidget


@pytest.fixture
def trained(tmp_path) -> kit.Session:
    """3 epochs with a checkpoint each; model.001 corrupted (one byte), model.002 incomplete (no manifest)."""
    session = kit.Session(tiny_config(str(tmp_path / "model")))
    session.train()
    flip_byte(tmp_path / "model.001.pt")
    os.remove(tmp_path / "model.002.manifest.json")
    return session


def test_table_marks_corrupt_and_incomplete(trained) -> None:
    widget = trained.checkpoints.widget()
    assert isinstance(widget, CheckpointWidget)
    widget = CheckpointWidget(trained.checkpoints, mode="widget")
    states = {r["name"]: line.split()[1] for line, r in zip(widget.text().splitlines()[1:], widget.rows)}
    assert states == {"model.001": "corrupt", "model.002": "incomplete", "model.003": "ok"}
    assert [value for _, value in widget.select.options] == ["model.001", "model.002", "model.003"]
    assert "dev_loss_ce" in widget.text().splitlines()[0]
    score = trained.info().score_table.scores(3)["dev_loss_ce"]
    assert f"{score:.4g}" in widget.text().splitlines()[3]
    assert widget.text().splitlines()[3].endswith("★ best dev_loss_ce")  # among the loadable ones
    assert "★" not in widget.text().splitlines()[1] + widget.text().splitlines()[2]
    assert set(widget._repr_mimebundle_()) == {
        "text/plain",
        "text/html",
        "application/vnd.jupyter.widget-view+json",
    }


@pytest.mark.parametrize("name", ["model.001", "model.002"])
def test_broken_checkpoints_cannot_be_loaded(trained, name) -> None:
    widget = CheckpointWidget(trained.checkpoints, mode="widget")
    widget.select_checkpoint(name)
    assert "cannot be loaded" in widget.details.value
    assert all(widget.buttons[b].disabled for b in ("load", "restore", "export"))
    assert not widget.buttons["delete"].disabled


def test_selection_shows_scores_statistics_and_difference_to_current(trained) -> None:
    widget = CheckpointWidget(trained.checkpoints, mode="widget")
    assert all(widget.buttons[b].disabled for b in ("load", "restore", "export"))  # nothing selected
    widget.select.value = "model.003"  # as a click in the list
    details = widget.details.value
    n_params = sum(p.numel() for p in trained.model.parameters())
    assert f"{n_params:,} values" in details
    assert "dev_loss_ce" in details and "inp.weight" in details
    assert "L2 difference to the current model 0<" in details  # the newest checkpoint is the current model
    with torch.no_grad():
        trained.model.out.bias.add_(1.0)
    widget.select.value = None
    widget.select.value = "model.003"
    assert "L2 difference to the current model 1.414" in widget.details.value  # sqrt(2) for 2 biases + 1


def test_export_load_restore_buttons(trained, tmp_path) -> None:
    widget = CheckpointWidget(trained.checkpoints, mode="widget")
    widget.select_checkpoint("model.003")
    widget.buttons["export"].click()
    path = tmp_path / "model.003.safetensors"
    assert path.is_file() and str(path) in widget.message.value
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(path))["out.bias"], trained.model.out.bias.detach())
    widget.buttons["load"].click()
    assert trained.status.startswith("inspecting") and "for inspection" in widget.message.value
    widget.buttons["restore"].click()
    widget.confirm_yes.click()
    assert trained.status == "ready" and "restored" in widget.message.value
    widget.select_checkpoint("model.001")
    widget.buttons["restore"].disabled = False  # even forced, a corrupt file is refused with a message
    widget.buttons["restore"].click()
    widget.confirm_yes.click()
    assert "CorruptCheckpointError" in widget.message.value and "does not match" in widget.message.value
    assert trained.status == "ready"


def test_delete_asks_for_confirmation(trained, tmp_path) -> None:
    widget = CheckpointWidget(trained.checkpoints, mode="widget")
    widget.select_checkpoint("model.001")
    widget.buttons["delete"].click()
    assert widget.confirm.layout.display == "flex" and "model.001" in widget.confirm_text.value
    assert (tmp_path / "model.001.pt").exists()
    widget.confirm_no.click()
    assert widget.confirm.layout.display == "none" and (tmp_path / "model.001.pt").exists()
    widget.buttons["delete"].click()
    widget.confirm_yes.click()
    assert not (tmp_path / "model.001.pt").exists() and not (tmp_path / "model.001.manifest.json").exists()
    assert [r["name"] for r in widget.rows] == ["model.002", "model.003"]
    assert "deleted model.001" in widget.message.value
    widget.select_checkpoint("model.003")  # the session's newest checkpoint is kept
    widget.buttons["delete"].click()
    widget.confirm_yes.click()
    assert "kept" in widget.message.value and (tmp_path / "model.003.pt").exists()


def test_text_mode_table(trained) -> None:
    widget = CheckpointWidget(trained.checkpoints, mode="text")
    assert widget.widget is None
    assert set(widget._repr_mimebundle_()) == {"text/plain"}
    assert repr(widget) == widget.text() and len(widget.text().splitlines()) == 4


def test_restore_asks_for_confirmation_and_every_action_refreshes_and_clears_the_message(trained, tmp_path) -> None:
    widget = CheckpointWidget(trained.checkpoints, mode="widget")
    widget.select_checkpoint("model.003")
    with torch.no_grad():
        trained.model.out.bias.add_(1.0)  # the current model moves away from model.003
    widget.buttons["export"].click()
    assert "wrote" in widget.message.value
    assert "L2 difference to the current model 1.414" in widget.details.value  # read again after the action
    widget.buttons["restore"].click()
    assert widget.message.value == ""  # the export's message is gone
    assert widget.confirm.layout.display == "flex" and "model.003" in widget.confirm_text.value
    assert widget.confirm_yes.description == "Yes, restore"
    widget.confirm_no.click()
    assert widget.confirm.layout.display == "none" and trained.model.out.bias.detach().abs().min() > 0.5
    widget.buttons["restore"].click()
    widget.confirm_yes.click()
    assert "restored" in widget.message.value and trained.status == "ready"
    assert "L2 difference to the current model 0<" in widget.details.value  # restored: no difference left
    widget.buttons["delete"].click()
    assert widget.message.value == "" and widget.confirm_yes.description == "Yes, delete"
    widget.confirm_no.click()
    widget.buttons["load"].click()
    assert "for inspection" in widget.message.value and "restored" not in widget.message.value


def test_the_widget_refreshes_itself_on_new_checkpoints_and_cleanup(tmp_path) -> None:
    """Shown once, it lists every checkpoint the session saves (and drops those the cleanup removes)
    without a Refresh click."""
    session = kit.Session(tiny_config(str(tmp_path / "model"), num_epochs=1,
                                      cleanup_old_models={"keep_last_n": 1, "keep_best_n": 0}))
    session.setup()
    widget = session.checkpoints.widget()
    assert widget.rows == []
    session.train_steps(3)
    session.save()  # a step checkpoint: the checkpoint_saved event
    widget.wait_for_refresh()
    assert [r["name"] for r in widget.rows] == ["model.001.step00000003"]
    session.extend(3)
    session.train()  # epoch checkpoints; the cleanup keeps the newest one only
    widget.wait_for_refresh()
    on_disk = [c.name for c in session.checkpoints.list()]
    assert [r["name"] for r in widget.rows] == on_disk and "model.003" in on_disk
    stale = CheckpointWidget(session.checkpoints, mode="text")  # a control: made without the session's events
    session.extend(4)
    session.train()
    widget.wait_for_refresh()
    assert [r["name"] for r in widget.rows] == [c.name for c in session.checkpoints.list()] != [
        r["name"] for r in stale.rows]
