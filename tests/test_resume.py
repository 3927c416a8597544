"""Resume: a stopped and restarted run ends bit-for-bit where an uninterrupted one does.

Every parity test compares with :func:`helpers.training_script.reference_run` (same config:
dropout, ``random`` order, grad accumulation 2, a grad scaler, step checkpoints every 5
steps; no data workers) and has a negative control with one ingredient switched off.
Resumed runs use 2 data workers where the brief asks for them: with workers, the batches and
the training randomness must be exactly those of a run without.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch
from helpers.models import TinyModel, tiny_config
from helpers.training_script import (
    STEPS_PER_EPOCH,
    Recorder,
    config,
    copy_run,
    reference_run,
    snapshot,
)

import kit
import kit.data.pipeline
import kit.data.workers
import kit.engine.state
from kit import checkpoints
from kit.engine.engine import Engine
from kit.engine.updater import Updater
from kit.errors import CheckpointError

WORKERS = {"torch_dataloader_opts": {"num_workers": 2}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(str(tmp_path_factory.getbasetemp() / "reference"))


def stop_after(n: int):
    """A ``should_stop`` that stops after ``n`` calls (one call per finished train step)."""
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) >= n

    return should_stop


def start_engine(prefix, **overrides) -> tuple[Engine, Recorder]:
    recorder = Recorder()
    return recorder.attach(Engine(config(prefix, **overrides))), recorder


def assert_same_as(result, reference, losses=None):
    if losses is not None:
        assert losses == reference.losses
    assert result.state.keys() == reference.state.keys()
    assert all(torch.equal(result.state[k], reference.state[k]) for k in reference.state)
    assert optimizer_states_equal(result.optimizer, reference.optimizer)
    assert result.scaler == reference.scaler
    assert result.scores == reference.scores


def optimizer_states_equal(a: dict, b: dict) -> bool:
    sa, sb = a["state"], b["state"]
    if sa.keys() != sb.keys() or a["param_groups"] != b["param_groups"]:
        return False
    return all(
        (torch.equal(v, sb[k][name]) if isinstance(v, torch.Tensor) else v == sb[k][name])
        for k in sa
        for name, v in sa[k].items()
    )


def train_rest(engine: Engine, recorder: Recorder):
    try:
        engine.train()
        return snapshot(engine, recorder.losses)
    finally:
        engine.close()


# ---- parity: epoch boundary -----------------------------------------------------------------


def test_stop_at_epoch_boundary_and_rerun_continues_bit_exactly(tmp_path, reference):
    prefix = tmp_path / "model"
    first, rec1 = start_engine(prefix, **WORKERS)
    assert first.train(lambda: not first.progress.epoch_running and first.progress.epoch == 2) is False
    first.close()
    assert checkpoints.latest(str(prefix)).name == "model.001"

    second, rec2 = start_engine(prefix, **WORKERS)
    second.setup()
    assert (second.progress.epoch, second.progress.epoch_running) == (2, False)
    result = train_rest(second, rec2)
    assert rec2.losses[0][0] == STEPS_PER_EPOCH  # nothing of epoch 1 was trained again
    assert_same_as(result, reference, rec1.losses + rec2.losses)


@pytest.mark.parametrize("ingredient", ["optimizer", "grad_scaler"])
def test_epoch_boundary_control_differs_without_one_ingredient(tmp_path, reference, monkeypatch, ingredient):
    prefix = copy_run(reference, tmp_path)
    for ckpt in checkpoints.list_checkpoints(prefix):  # back to the end of epoch 1
        if ckpt.global_train_step > STEPS_PER_EPOCH:
            checkpoints.delete(ckpt)
    if ingredient == "optimizer":
        monkeypatch.setattr(Updater, "load_state_dict", lambda self, state: None)
    else:
        monkeypatch.setattr(torch.amp.GradScaler, "load_state_dict", lambda self, state: None)
    engine, recorder = start_engine(prefix)
    result = train_rest(engine, recorder)
    if ingredient == "optimizer":
        assert recorder.losses != reference.losses[STEPS_PER_EPOCH:]
        assert not all(torch.equal(result.state[k], reference.state[k]) for k in reference.state)
    else:  # scaling by powers of two is exact: only the scaler's own state shows it
        assert result.scaler["scale"] != reference.scaler["scale"]


def test_raising_num_epochs_continues_training(tmp_path, reference):
    prefix = tmp_path / "model"
    engine, rec1 = start_engine(prefix, num_epochs=1)
    train_rest(engine, rec1)
    files = sorted(os.listdir(tmp_path))

    again, rec_again = start_engine(prefix, num_epochs=1)  # finished: a re-run does nothing
    assert again.train() is True
    again.close()
    assert rec_again.losses == [] and sorted(os.listdir(tmp_path)) == files

    more, rec2 = start_engine(prefix, num_epochs=2)
    result = train_rest(more, rec2)
    assert_same_as(result, reference, rec1.losses + rec2.losses)
    assert kit.ScoreTable.load(f"{prefix}.scores.json").epochs == [1, 2]


# ---- parity: mid-epoch ------------------------------------------------------------------------


def test_killed_mid_epoch_resumes_from_step_checkpoint_inside_open_accumulation_window(tmp_path, reference):
    prefix = tmp_path / "model"
    first, rec1 = start_engine(prefix, **WORKERS)
    first.train(stop_after(7))  # dies after 7 steps: nothing saved since the step-5 checkpoint
    first.close()
    ckpt = checkpoints.latest(str(prefix))
    assert (ckpt.kind, ckpt.global_train_step) == ("step", 5)
    _, state = checkpoints.load_checkpoint(ckpt)
    assert state["progress"]["accum_count"] == 1 and state["grads"]  # the window [4, 5] is open

    second, rec2 = start_engine(prefix, **WORKERS)
    result = train_rest(second, rec2)
    assert rec2.losses[0][0] == 5
    assert_same_as(result, reference, rec1.losses[:5] + rec2.losses)


def test_in_returnns_layout_a_kill_mid_epoch_resumes_bit_exactly_without_manifest_files(tmp_path, reference):
    """run_files='returnn': the manifest lives in the model file, written last; resuming is as bitwise."""
    prefix = tmp_path / "model"
    first, rec1 = start_engine(prefix, run_files="returnn", **WORKERS)
    first.train(stop_after(7))
    first.close()
    assert not list(tmp_path.glob("*.manifest.json"))
    ckpt = checkpoints.latest(str(prefix))
    assert (ckpt.kind, ckpt.global_train_step, ckpt.embedded) == ("step", 5, True)
    second, rec2 = start_engine(prefix, run_files="returnn", **WORKERS)
    result = train_rest(second, rec2)
    assert rec2.losses[0][0] == 5
    assert_same_as(result, reference, rec1.losses[:5] + rec2.losses)
    assert not list(tmp_path.glob("*.manifest.json"))


def test_stopped_after_the_last_step_before_the_epoch_end_work_resumes_with_it(tmp_path, reference):
    prefix = tmp_path / "model"
    first, rec1 = start_engine(prefix, save_every_n_steps=STEPS_PER_EPOCH)
    first.train(stop_after(STEPS_PER_EPOCH))  # epoch 1's data is used up; no eval, no epoch checkpoint yet
    first.close()
    ckpt = checkpoints.latest(str(prefix))
    assert (ckpt.kind, ckpt.epoch, ckpt.global_train_step) == ("step", 1, STEPS_PER_EPOCH)
    assert not os.path.exists(f"{prefix}.scores.json")

    second, rec2 = start_engine(prefix, save_every_n_steps=STEPS_PER_EPOCH)
    second.setup()
    assert second.progress.accum_count == 1  # the partial window [18] is applied by the epoch end
    result = train_rest(second, rec2)
    assert rec2.losses[0][0] == STEPS_PER_EPOCH
    assert_same_as(result, reference, rec1.losses + rec2.losses)


@pytest.fixture
def step5_run(tmp_path, reference):
    """A run that stopped after 7 steps of epoch 1; its newest checkpoint is the one of step 5."""
    prefix = tmp_path / "model"
    engine, _ = start_engine(prefix)
    engine.train(stop_after(7))
    engine.close()
    return prefix


def _restoring_without(monkeypatch, field: str) -> None:
    """A negative control: the engine restores the saved training state but for one ingredient
    (``rng``: the RNG stays as it is; ``grads``: the open window's gradients are dropped)."""
    real = Engine.restore_state

    def restore_state(self, state, **kwargs):
        value = kit.rng.RngState.capture() if field == "rng" else None
        real(self, dataclasses.replace(state, **{field: value}), **kwargs)

    monkeypatch.setattr(Engine, "restore_state", restore_state)


@pytest.mark.parametrize("ingredient", ["rng", "data_position", "open_window_grads", "worker_seed_generator"])
def test_mid_epoch_control_differs_without_one_ingredient(step5_run, reference, monkeypatch, ingredient):
    overrides = {}
    if ingredient == "rng":
        _restoring_without(monkeypatch, "rng")
    elif ingredient == "data_position":
        monkeypatch.setattr(kit.data.pipeline.Pipeline, "load_state_dict", lambda self, state: None)
    elif ingredient == "open_window_grads":
        _restoring_without(monkeypatch, "grads")
    else:  # the DataLoader draws its workers' base seed from the global torch RNG again
        real_init = kit.data.workers.WorkerPool.__init__

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            self.dataloader.generator = None

        monkeypatch.setattr(kit.data.workers.WorkerPool, "__init__", init)
        overrides = WORKERS
    engine, recorder = start_engine(step5_run, **overrides)
    for _ in range(4):
        engine.train_step()
    engine.close()
    assert [s for s, _, _ in recorder.losses] == [5, 6, 7, 8]
    assert recorder.losses != reference.losses[5:9]


def test_session_save_mid_epoch_and_a_new_session_continues_bit_exactly(tmp_path, reference):
    cfg = config(tmp_path / "model", **WORKERS)
    with kit.Session(cfg) as first:
        first.train_steps(STEPS_PER_EPOCH + 7)  # epoch 2, step 7: the window [6, 7] is open
        assert (first.epoch, first.step_in_epoch, first.engine.progress.accum_count) == (2, 7, 1)
        ckpt = first.save()
        before = first.history
    assert (ckpt.kind, ckpt.global_train_step) == ("step", STEPS_PER_EPOCH + 7)

    with kit.Session(cfg) as second:
        second.setup()
        assert (second.epoch, second.step_in_epoch, second.global_train_step) == (2, 7, STEPS_PER_EPOCH + 7)
        second.train()
        after = second.history
        result = snapshot(second.engine, [])
    assert list(before["global_train_step"]) + list(after["global_train_step"]) == list(
        range(2 * STEPS_PER_EPOCH)
    )
    assert list(before["ce"]) + list(after["ce"]) == [ce for _, ce, _ in reference.losses]
    assert list(before["fer"]) + list(after["fer"]) == [fer for _, _, fer in reference.losses]
    assert_same_as(result, reference)


def test_session_save_control_differs_without_rng_restore(tmp_path, reference, monkeypatch):
    cfg = config(tmp_path / "model")
    with kit.Session(cfg) as first:
        first.train_steps(STEPS_PER_EPOCH + 7)
        first.save()
    _restoring_without(monkeypatch, "rng")
    with kit.Session(cfg) as second:
        second.train_steps(3)
        ce = list(second.history["ce"])
    assert ce != [c for _, c, _ in reference.losses[STEPS_PER_EPOCH + 7 : STEPS_PER_EPOCH + 10]]


# ---- the score table on resume -----------------------------------------------------------------


def test_scores_of_epochs_being_trained_again_are_dropped_and_lost_rows_come_back(tmp_path, reference):
    prefix = copy_run(reference, tmp_path)
    for ckpt in checkpoints.list_checkpoints(prefix):  # as if killed while saving epoch 2
        if ckpt.global_train_step > 30:
            checkpoints.delete(ckpt)
    table = kit.ScoreTable.load(f"{prefix}.scores.json")
    assert table.has_scores(2, "train_loss_")
    engine, _ = start_engine(prefix)
    engine.setup()
    assert (engine.progress.epoch, engine.progress.global_train_step) == (2, 30)
    on_disk = kit.ScoreTable.load(f"{prefix}.scores.json")
    assert on_disk.epochs == [1, 2] and on_disk.scores(1) == reference.scores[1]
    assert on_disk.scores(2) == {} and on_disk.learning_rate(2) == table.learning_rate(2)
    engine.close()

    os.unlink(f"{prefix}.scores.json")  # lost: the checkpoint's copy brings epoch 1 back
    engine, recorder = start_engine(prefix)
    result = train_rest(engine, recorder)
    assert result.scores == reference.scores
    assert recorder.losses == reference.losses[30:]


# ---- RETURNN's missing-eval rule --------------------------------------------------------------


def test_last_epoch_without_eval_scores_is_evaluated_at_start(tmp_path):
    prefix = tmp_path / "model"
    train_rest(*start_engine(prefix, num_epochs=1, dev=None))
    events = []
    engine, _ = start_engine(prefix, num_epochs=2)
    for name in ("eval_begin", "epoch_begin"):
        engine.events.on(name, lambda _name=name, **_: events.append(_name))
    engine.setup()
    assert events == ["eval_begin"]
    assert kit.ScoreTable.load(f"{prefix}.scores.json").has_scores(1, "dev_loss_")
    train_rest(engine, Recorder())
    assert events == ["eval_begin", "epoch_begin", "eval_begin"]


def test_an_older_epoch_without_eval_scores_is_a_clear_error(tmp_path):
    prefix = tmp_path / "model"
    train_rest(*start_engine(prefix, num_epochs=2, dev=None))
    engine, _ = start_engine(prefix, num_epochs=3)
    with pytest.raises(CheckpointError, match=r"epoch 1 has no scores for eval dataset\(s\) 'dev'"):
        engine.setup()


# ---- RETURNN's load, load_epoch, start_epoch, import_model_train_epoch1 ------------------------


def weights_of(path) -> dict[str, torch.Tensor]:
    return checkpoints.load(path)["model"]


def same_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)


def fresh_weights() -> dict[str, torch.Tensor]:
    engine = Engine(kit.Config(tiny_config()))
    engine.setup()
    return engine.model.state_dict()


def test_start_epoch_picks_the_checkpoint_before_it(tmp_path, reference, caplog):
    prefix = copy_run(reference, tmp_path)
    engine, _ = start_engine(prefix, start_epoch=2)
    engine.setup()
    _, state = checkpoints.load_checkpoint(
        next(c for c in checkpoints.list_checkpoints(prefix) if c.name == "model.001")
    )
    assert (engine.progress.epoch, engine.progress.global_train_step) == (2, STEPS_PER_EPOCH)
    assert same_weights(engine.model, weights_of(f"{prefix}.001.pt"))
    assert optimizer_states_equal(engine.optimizer.state_dict(), state["optimizer"])
    assert kit.ScoreTable.load(f"{prefix}.scores.json").scores(2) == {}
    engine.close()

    with caplog.at_level(logging.WARNING, logger="kit"):
        engine, _ = start_engine(prefix, start_epoch=1)
        engine.setup()
    assert "start_epoch=1: ignoring the existing checkpoints" in caplog.text
    assert (engine.progress.epoch, engine.progress.global_train_step) == (1, 0)
    assert same_weights(engine.model, fresh_weights())

    with pytest.raises(CheckpointError, match=r"'start_epoch': no complete checkpoint of epoch 3 .*\[1, 2\]"):
        start_engine(prefix, start_epoch=4)[0].setup()


def test_load_epoch_chooses_the_weights_when_not_training_and_is_ignored_by_a_rerun(tmp_path, reference):
    prefix = copy_run(reference, tmp_path)
    evaluating = Engine(config(prefix, load_epoch=1))
    evaluating.task = "eval"
    evaluating.setup()
    assert same_weights(evaluating.model, weights_of(f"{prefix}.001.pt"))
    assert evaluating.optimizer is None  # weights only: no training state was loaded

    forward_only = Engine(kit.Config(tiny_config(prefix, train_step=None, train=None)))
    forward_only.setup()  # not a training config: the newest checkpoint, weights only
    assert same_weights(forward_only.model, weights_of(f"{prefix}.002.pt"))

    training = Engine(config(prefix, load_epoch=1))  # RETURNN: training continues after the newest
    training.setup()
    assert training.progress.epoch == 3 and same_weights(training.model, weights_of(f"{prefix}.002.pt"))

    with pytest.raises(CheckpointError, match="'load_epoch': no complete checkpoint of epoch 1"):
        Engine(config(tmp_path / "empty" / "model", load_epoch=1)).setup()


def test_load_a_kit_checkpoint_continues_its_training_state_elsewhere(tmp_path, reference):
    source = copy_run(reference, tmp_path)
    engine, recorder = start_engine(
        tmp_path / "new" / "model", load=f"{source}.001"
    )  # RETURNN: no .pt needed
    engine.setup()
    assert (engine.progress.epoch, engine.progress.global_train_step) == (2, STEPS_PER_EPOCH)
    result = train_rest(engine, recorder)
    assert_same_as(result, reference, reference.losses[:STEPS_PER_EPOCH] + recorder.losses)
    assert checkpoints.latest(str(tmp_path / "new" / "model")).name == "model.002"


def test_load_a_plain_model_file_gives_weights_and_epoch(tmp_path):
    weights = {k: torch.full_like(v, 0.25) for k, v in TinyModel().state_dict().items()}
    torch.save(weights, tmp_path / "plain.pt")
    torch.save({"model": weights, "epoch": 3, "step": 40}, tmp_path / "other.pt")
    torch.save({"model": weights}, tmp_path / "net.004.pt")
    for name, epoch, step in [("plain.pt", 1, 0), ("other.pt", 4, 40), ("net.004.pt", 5, 0)]:
        with kit.Session(config(tmp_path / f"run_{epoch}" / "model", load=str(tmp_path / name))) as session:
            session.setup()
            assert (session.epoch, session.global_train_step) == (epoch, step), name
            assert same_weights(session.model, weights)
            assert not session.optimizer.state_dict()["state"]  # a fresh optimizer

    with pytest.raises(CheckpointError, match="'load': file .*missing.pt' does not exist"):
        Engine(config(tmp_path / "m", load=str(tmp_path / "missing.pt"))).setup()


def test_existing_checkpoints_win_over_load_and_import(tmp_path, reference):
    prefix = copy_run(reference, tmp_path)
    engine = Engine(
        config(prefix, num_epochs=3, load=f"{prefix}.001.pt", import_model_train_epoch1=f"{prefix}.001.pt")
    )
    engine.setup()
    assert engine.progress.epoch == 3 and same_weights(engine.model, weights_of(f"{prefix}.002.pt"))


def test_import_model_train_epoch1_starts_at_epoch_one_with_its_weights(tmp_path, reference):
    with kit.Session(
        config(tmp_path / "model", import_model_train_epoch1=f"{reference.prefix}.002")
    ) as session:
        session.setup()
        assert (session.epoch, session.global_train_step) == (1, 0)
        assert same_weights(session.model, weights_of(f"{reference.prefix}.002.pt"))
        assert not session.optimizer.state_dict()["state"]


@pytest.mark.parametrize("command", ["eval", "forward"])
def test_cli_eval_and_forward_use_load_epoch_weights(tmp_path, reference, command):
    from kit.cli import main

    prefix = copy_run(reference, tmp_path)
    seen = tmp_path / "seen.pt"
    config_file = tmp_path / "config.py"
    config_file.write_text(
        "import torch\n"
        "from helpers.training_script import config\n"
        f"globals().update(config({prefix!r}).as_dict())\n"
        "def _record(*, model, **_):\n"
        f"    torch.save(model.state_dict(), {str(seen)!r})\n"
        "load_model_post_hooks = [_record]\n"
    )
    args = [command, str(config_file), "load_epoch=1"]
    assert main(args + (["--output", str(tmp_path / "out.npz")] if command == "forward" else [])) == 0
    assert all(torch.equal(v, weights_of(f"{prefix}.001.pt")[k]) for k, v in checkpoints.load(seen).items())
