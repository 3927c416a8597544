"""kit.Session: construction, position, extend/save, eval, forward, scores, history, events, lifetime."""

from __future__ import annotations

import gc
import multiprocessing
import re
import subprocess
import sys
import weakref

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.models import TinyModel, forward_step, tiny_config
from helpers.models import train_step as tiny_train_step
from session_testlib import LossRecorder, score_part, state, states_equal, write_config

import kit
from kit.data import Task12AXDataset, batches

# ---- construction -------------------------------------------------------------------------


def test_every_way_of_construction_gives_the_same_run(tmp_path):
    cfg = tiny_config(num_epochs=1)
    config = kit.Config(cfg)
    path = write_config(tmp_path / "config.py", extra="num_epochs = 7")
    sessions = [
        kit.Session(**cfg),
        kit.Session(config),
        kit.Session(config=config),
        kit.Session(config=cfg),
        kit.Session.from_config(path, num_epochs=1),  # datasets as dicts, an override
    ]
    for s in sessions:
        s.train_steps(4)
    first = state(sessions[0].model)
    assert all(states_equal(first, state(s.model)) for s in sessions[1:])
    assert all(s.config.int("num_epochs") == 1 for s in sessions)
    assert isinstance(sessions[4].engine.datasets["train"], Task12AXDataset)


def test_keywords_next_to_a_config_override_it_without_changing_it():
    config = kit.Config(tiny_config(num_epochs=3))
    s = kit.Session(config=config, num_epochs=5, learning_rate=0.5)
    assert (s.config.int("num_epochs"), s.config.float("learning_rate")) == (5, 0.5)
    assert (config.int("num_epochs"), config.float("learning_rate")) == (3, 0.01)
    with pytest.raises(kit.ConfigError, match="learnig_rate.*learning_rate"):
        kit.Session(config=config, learnig_rate=0.1)
    with pytest.raises(TypeError, match="from_config"):
        kit.Session("config.py")


def test_construction_builds_nothing_until_first_use():
    built = []

    def get_model(**_kwargs):
        built.append(1)
        return TinyModel()

    children = set(multiprocessing.active_children())
    cuda_was_initialized = torch.cuda.is_initialized()
    s = kit.Session(**tiny_config(get_model=get_model, torch_dataloader_opts={"num_workers": 1}))
    repr(s), s._repr_html_(), s.config  # looking at it builds nothing either
    assert built == []
    assert s.engine.model is None and s.engine.device is None and s.engine.lr_control is None  # no train parts
    with pytest.raises(kit.SessionStateError, match="not built yet.*setup"):
        _ = s.model  # a property builds nothing
    assert set(multiprocessing.active_children()) == children
    assert torch.cuda.is_initialized() == cuda_was_initialized
    s.train_step()
    assert built == [1] and isinstance(s.model, TinyModel)
    assert set(multiprocessing.active_children()) - children  # the data worker runs now
    s.close()
    assert set(multiprocessing.active_children()) == children


def test_parts_and_position():
    made = []

    def get_model(**_kwargs):
        made.append(TinyModel())
        return made[-1]

    s = kit.Session(**tiny_config(get_model=get_model))
    assert (s.epoch, s.global_train_step, s.step_in_epoch) == (1, 0, 0)
    s.setup()  # builds the model and the optimizer; properties only read them
    assert s.model is made[0]
    assert isinstance(s.optimizer, torch.optim.Adam)
    assert {id(p) for g in s.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in made[0].parameters()
    }
    assert isinstance(s.config, kit.Config)
    r = s.train_steps(3)
    assert (r.epoch, r.step, r.global_train_step) == (1, 2, 2)
    assert (s.epoch, s.global_train_step, s.step_in_epoch) == (1, 3, 3)
    assert s.learning_rate == 0.01
    assert set(r.losses) == {"ce", "fer"} and r.losses["ce"] > 0


# ---- train_* mixes, extend, save, restart --------------------------------------------------


def test_step_counters_of_mixed_calls_equal_a_plain_train(reference):
    hist = reference["history"]
    s = kit.Session(**tiny_config())
    r = s.train_step()
    assert (r.epoch, r.step, r.global_train_step) == (1, 0, 0)
    r = s.train_steps(20)  # more than epoch 1 has: rolls into epoch 2 with the epoch-end work
    ref = hist[hist.global_train_step == 20].iloc[0]
    assert (r.epoch, r.step, r.global_train_step) == (ref.epoch, ref.step, 20) == (2, ref.step, 20)
    assert list(s.scores.dropna(subset=["train_loss_ce"]).index) == [1]
    row = s.train_epoch()  # the rest of epoch 2: its scores
    assert row == {k: v for k, v in reference["scores"].loc[2].items() if k in row}
    assert (s.epoch, s.step_in_epoch) == (3, 0)
    s.train_steps(3)
    assert s.train()["train_loss_ce"] == reference["scores"].loc[3, "train_loss_ce"]
    assert states_equal(state(s.model), reference["state"])
    assert s.global_train_step == reference["global_train_step"] and s.epoch == 4
    pd.testing.assert_frame_equal(score_part(s.scores), score_part(reference["scores"]))
    pd.testing.assert_frame_equal(
        s.history[["global_train_step", "epoch", "step", "ce", "fer"]],
        hist[["global_train_step", "epoch", "step", "ce", "fer"]],
    )
    assert s.status == "finished"
    r = s.train_step()  # nothing left: says so and returns (a rerun of a cell must not fail)
    assert r.outcome == "finished" and r.last_step is None
    assert re.search("all 3 epochs are trained.*extend", r.summary())


def test_train_to_an_epoch_then_extend_keeps_lr_control_and_history(reference):
    s = kit.Session(**tiny_config())
    s.train(num_epochs=1)  # stop after epoch 1
    assert s.epoch == 2 and s.status == "finished"
    lr_control, steps = s.engine.lr_control, len(s.history)
    s.extend(2)
    s.train()
    with pytest.raises(ValueError, match=r"must be >= the current num_epochs 2; use train\(num_epochs=1\)"):
        s.extend(1)
    with pytest.raises(ValueError, match="epoch 2 is already trained"):
        s.train(num_epochs=1)
    s.train(num_epochs=3)
    assert s.engine.lr_control is lr_control and len(s.history) > steps
    assert len(s.history) == reference["global_train_step"]
    assert states_equal(state(s.model), reference["state"])
    pd.testing.assert_frame_equal(score_part(s.scores), score_part(reference["scores"]))


def test_save_then_restart_resumes_at_that_step_and_continues_equal(tmp_path, reference):
    prefix = str(tmp_path / "model")
    s = kit.Session(**tiny_config(prefix))
    s.train_epoch()
    s.train_steps(5)
    ckpt = s.save()
    assert ckpt.kind == "step" and ckpt.global_train_step == s.global_train_step
    assert "step" in set(s.checkpoints.table["kind"])
    position, scores = (s.epoch, s.step_in_epoch, s.global_train_step), s.scores
    s.close()
    # a "kernel restart": the same config in a new session
    s2 = kit.Session(**tiny_config(prefix))
    assert (s2.progress.epoch, s2.progress.global_train_step) == (2, position[2])  # planned, from the name
    s2.setup()  # loads the step checkpoint: the step in the epoch is in its training state
    assert (s2.epoch, s2.step_in_epoch, s2.global_train_step) == position == (2, 5, position[2])
    pd.testing.assert_frame_equal(s2.scores, scores)
    s2.train()
    assert states_equal(state(s2.model), reference["state"])
    pd.testing.assert_frame_equal(score_part(s2.scores), score_part(reference["scores"]))


def test_restart_from_a_config_file_shows_the_same_scores_and_continues(tmp_path, reference):
    path = write_config(tmp_path / "config.py")
    prefix = str(tmp_path / "run" / "model")
    s = kit.Session.from_config(path, model=prefix)
    s.train(num_epochs=2)
    before = s.scores
    s.close()
    s2 = kit.Session.from_config(path, model=prefix)
    pd.testing.assert_frame_equal(s2.scores, before)
    assert s2.epoch == 3
    s2.train()
    assert states_equal(state(s2.model), reference["state"])
    pd.testing.assert_frame_equal(score_part(s2.scores), score_part(reference["scores"]))


def test_scores_are_the_score_file(tmp_path):
    prefix = str(tmp_path / "model")
    s = kit.Session(**tiny_config(prefix, num_epochs=2))
    s.train_epoch()
    pd.testing.assert_frame_equal(s.scores, kit.ScoreTable.load(prefix + ".scores.json").to_pandas("scores"))
    s.train()
    frame, meta = s.scores, s.scores_meta
    full = kit.ScoreTable.load(prefix + ".scores.json").to_pandas()
    # session.scores: learning rate and scores only; the run's metadata apart; together the whole file
    assert list(frame.columns) == ["learning_rate", "train_loss_ce", "train_loss_fer", "dev_loss_ce", "dev_loss_fer"]
    assert {"epoch_num_train_steps", "epoch_train_time_secs", "hostname", "torch_version"} <= set(meta.columns)
    assert not set(frame.columns) & set(meta.columns)
    pd.testing.assert_frame_equal(pd.concat([frame, meta], axis=1)[list(full.columns)], full)
    assert list(frame.index) == [1, 2] and list(meta.index) == [1, 2]


# ---- eval and forward ---------------------------------------------------------------------


def test_eval_is_recorded_only_at_an_epoch_end():
    s = kit.Session(**tiny_config())
    assert set(s.eval()) == {"dev"} and s.scores.empty  # before any training: just returned
    s.train_epoch()
    recorded = s.scores.loc[1, "dev_loss_ce"]
    assert s.eval()["dev"]["dev_loss_ce"] == recorded  # same weights, same numbers
    with torch.no_grad():
        s.model.out.bias[0] += 0.5  # (the same shift on both logits would change nothing)
    new = s.eval()["dev"]
    assert new["dev_loss_ce"] != recorded and s.scores.loc[1, "dev_loss_ce"] == new["dev_loss_ce"]
    other = s.eval(Task12AXDataset(20, seed=9))  # a dataset of its own: returned, not recorded
    assert set(other) == {"eval"} and "eval_loss_ce" not in s.scores.columns
    s.train_step()  # mid-epoch: returned, not recorded
    mid = s.eval()["dev"]
    assert mid["dev_loss_ce"] != new["dev_loss_ce"] and s.scores.loc[1, "dev_loss_ce"] == new["dev_loss_ce"]
    assert 2 not in s.scores.dropna(subset=["dev_loss_ce"]).index


def test_forward_a_dataset_a_batch_and_seq_tags():
    dev = Task12AXDataset(30, seed=2)
    s = kit.Session(**tiny_config(dev=dev))
    s.train_steps(3)
    whole = s.forward(dev)
    assert isinstance(whole, kit.ForwardResult) and len(whole) == 30
    assert list(whole) == [dev.get_seq_tag(i) for i in range(30)]  # dataset order
    assert whole["seq-4"]["logits"].shape == (dev.get_seq_length(4)["data"], 2)
    batch = next(iter(batches(dev, batch_size=400, max_seqs=4, extern_data=dev.extern_data, train=False)))
    by_batch = s.forward(batch)
    assert list(by_batch) == batch.seq_tags
    tags = ["seq-7", "seq-1", "seq-20"]
    by_tag = s.forward(tags, dataset="dev")
    assert sorted(by_tag) == sorted(tags)
    for tag in [*tags, *batch.seq_tags]:
        out = by_tag[tag] if tag in by_tag else by_batch[tag]
        np.testing.assert_allclose(out["logits"], whole[tag]["logits"], rtol=1e-5, atol=1e-6)
    frame = by_tag.to_pandas()
    assert list(frame.index) == list(by_tag) and "logits" in frame.columns
    assert "3 sequences" in by_tag._repr_html_()
    seen = []

    class Callback:
        def init(self, *, model, **_):
            seen.append("init")

        def process_seq(self, *, seq_tag, outputs, **_):
            seen.append(seq_tag)

        def finish(self, **_):
            seen.append("finish")

    assert s.forward(["seq-3"], Callback(), dataset="dev") is None
    assert seen == ["init", "seq-3", "finish"]


def test_forward_misuse_errors_are_clear():
    s = kit.Session(**tiny_config())
    with pytest.raises(
        KeyError, match=r"unknown seq tag\(s\) \['nope'\].*known datasets: train, dev.*'seq-0'"
    ):
        s.forward(["seq-1", "nope"])
    with pytest.raises(KeyError, match=r"several datasets \('train', 'dev'\).*dataset=") as info:
        s.forward(["seq-1"])  # 12AX train and dev both name their sequences seq-<i>
    assert not str(info.value).startswith(("'", '"'))  # a message, not a quoted KeyError
    with pytest.raises(KeyError, match=r"forward\(dataset='test'\): no such dataset.*train, dev"):
        s.forward(["seq-1"], dataset="test")
    no_forward = kit.Session(**{**tiny_config(), "forward_step": None})
    with pytest.raises(kit.ConfigError, match="'forward_step' is not set"):
        no_forward.forward(Task12AXDataset(3))


# ---- history ------------------------------------------------------------------------------


def test_history_has_one_row_per_step_with_the_step_losses():
    s = kit.Session(**tiny_config(num_epochs=1))
    rec = LossRecorder()
    s.on("step_end", rec)
    s.train()
    h = s.history
    assert list(h.global_train_step) == rec.steps == list(range(len(rec.steps)))
    assert {"epoch", "step", "learning_rate", "seconds", "num_seqs", "ce", "fer"} <= set(h.columns)
    values = rec.stacked().to(torch.float64)
    expected_ce = (values[:, 0, 0] / values[:, 1, 0]).tolist()
    assert h.ce.tolist() == expected_ce
    assert (h.learning_rate == 0.01).all() and (h.seconds > 0).all()


def test_history_is_bounded_by_thinning_out_old_steps():
    s = kit.Session(**tiny_config(), history_max_rows=8)
    s.train_steps(5)
    assert list(s.history.global_train_step) == [0, 1, 2, 3, 4]
    s.train_epoch()  # 19+ steps: 4 halvings in one flush
    h = s.history
    assert 4 <= len(h) <= 8
    stride = int(h.global_train_step.iloc[1])
    assert stride in (4, 8) and (h.global_train_step % stride == 0).all() and h.global_train_step.iloc[0] == 0
    for _ in range(25):  # reading after every step keeps the bound too
        s.train_step()
        assert len(s.history) <= 8
    h = s.history
    assert (h.global_train_step.diff().dropna() == h.global_train_step.diff().dropna().iloc[0]).all()
    with pytest.raises(ValueError, match="max_rows"):
        kit.Session(**tiny_config(), history_max_rows=0)


# ---- events and views ---------------------------------------------------------------------


def test_events_fire_where_the_loop_says(tmp_path):
    s = kit.Session(**tiny_config(str(tmp_path / "model"), num_epochs=1))
    calls: dict[str, list] = {}
    for name in ("step_end", "epoch_end", "eval_end", "checkpoint_saved", "interrupt"):
        s.on(name, lambda _name=name, **payload: calls.setdefault(_name, []).append(payload))
    s.train()
    assert len(calls["step_end"]) == s.global_train_step
    assert [c["epoch"] for c in calls["epoch_end"]] == [1]
    assert calls["epoch_end"][0]["scores"]["dev_loss_ce"] == s.scores.loc[1, "dev_loss_ce"]
    assert list(calls["eval_end"][0]["scores"]) == ["dev"]
    assert [c["checkpoint"].epoch for c in calls["checkpoint_saved"]] == [1]
    assert "interrupt" not in calls


def test_exception_and_nonfinite_events():
    def train_step(*, model, extern_data, **kwargs):
        step = kit.get_run_ctx().step
        if step == 2 and fail_at_2:
            raise RuntimeError("boom at step 2")
        tiny_train_step(model=model, extern_data=extern_data, **kwargs)
        if step == 4:
            kit.get_run_ctx().mark_as_loss(torch.tensor(float("nan")), "bad")

    fail_at_2 = True
    s = kit.Session(**tiny_config(train_step=train_step, nonfinite_policy="skip"))
    seen = {"exception": [], "nonfinite": []}
    s.on("exception", lambda **p: seen["exception"].append(p))
    s.on("nonfinite", lambda **p: seen["nonfinite"].append(p))
    s.train_steps(2)
    with pytest.raises(RuntimeError, match="boom at step 2"):
        s.train_step()
    assert [str(p["error"]).split("\n")[0] for p in seen["exception"]] == ["boom at step 2"]
    assert seen["exception"][0]["stage"] == "train" and s.status.startswith("error: RuntimeError")
    fail_at_2 = False
    s2 = kit.Session(**tiny_config(train_step=train_step, nonfinite_policy="skip"))
    s2.on("nonfinite", lambda **p: seen["nonfinite"].append(p))
    s2.train_steps(6)
    assert len(seen["nonfinite"]) == 1 and "loss bad" in str(seen["nonfinite"][0]["error"])
    assert s2._parts.engine.progress.num_updates == 5


def test_pause_from_a_subscriber_returns_paused_and_fires_interrupt():
    s = kit.Session(**tiny_config())
    interrupts = []
    s.on("interrupt", lambda status, **_: interrupts.append(status))
    s.on("step_end", lambda result, **_: s.pause() if result.global_train_step == 5 else None)
    r = s.train()
    assert r.paused and (r.epoch, r.step) == (1, 6) and s.status == "paused"
    assert str(r).startswith("paused at epoch 1, step 6") and "train" in str(r)
    assert interrupts == [r] and s.global_train_step == 6


def test_show_loop_names_each_subscriber_under_its_event(capsys):
    s = kit.Session(**tiny_config())

    def my_logger(**_):
        pass

    s.on("epoch_end", my_logger)
    text = s.show_loop()
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("epoch_end("))
    assert "my_logger" in lines[at + 1] and "my_logger" not in "".join(lines[:at])
    assert any("History.on_step_end" in line for line in lines)


def test_show_loop_works_without_docstrings():
    """``python -OO`` strips docstrings: the loop's outline is data, not parsed from one."""
    code = "import kit.events as e; text = e.show_loop(); print('epoch_end' in text and 'step_end' in text)"
    out = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("True")


def test_repr_html_tells_device_size_position_lr_scores_checkpoints(tmp_path):
    s = kit.Session(**tiny_config(str(tmp_path / "model"), num_epochs=1))
    assert "not built yet" in s._repr_html_()
    s.train()
    html = s._repr_html_()
    n = sum(p.numel() for p in s.model.parameters())
    for part in ("cpu", f"{n:,} parameters", "epoch 2 of 1", "0.01", "dev_loss_ce", "model.001"):
        assert part in html, part


# ---- lifetime -----------------------------------------------------------------------------


def test_close_frees_the_model_and_with_closes():
    with kit.Session(**tiny_config()) as s:
        s.train_steps(2)
        model, optimizer = weakref.ref(s.model), weakref.ref(s.optimizer)
    gc.collect()
    assert model() is None and optimizer() is None and s.status == "closed"
    with pytest.raises(kit.SessionStateError, match="closed"):
        s.train_step()


def test_close_drops_a_stored_traceback_that_holds_the_model(monkeypatch):
    def failing_step(*, model, extern_data, **_):
        raise ValueError("user bug")

    s = kit.Session(**tiny_config(train_step=failing_step))
    try:
        s.train_step()
    except ValueError:
        # what IPython does with an uncaught exception: keep it for %debug / %tb
        exc_type, exc, tb = sys.exc_info()
    monkeypatch.setattr(sys, "last_type", exc_type, raising=False)
    monkeypatch.setattr(sys, "last_value", exc, raising=False)
    monkeypatch.setattr(sys, "last_traceback", tb, raising=False)
    del exc, tb
    other = ValueError("unrelated")
    model = weakref.ref(s.model)
    s.close()
    gc.collect()
    assert model() is None and sys.last_traceback is None and sys.last_value is None
    # a stored exception that does not hold the session stays
    monkeypatch.setattr(sys, "last_value", other, raising=False)
    s2 = kit.Session(**tiny_config())
    s2.train_step()
    s2.close()
    assert sys.last_value is other


def test_misuse_errors_are_clear(tmp_path):
    s = kit.Session(**tiny_config(str(tmp_path / "model"), num_epochs=1))
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        s.train_steps(0)
    s.train()
    s.extend(2)
    s.checkpoints.load(1)
    with pytest.raises(kit.SessionStateError, match=r"checkpoints\.load.*restore\(.*reload_latest\(\)"):
        s.train_epoch()
    with pytest.raises(kit.SessionStateError, match="reload_latest"):
        s.save()
    no_train = kit.Session(**{**tiny_config(), "train": None})
    with pytest.raises(kit.ConfigError, match="'train' is not set"):
        no_train.train_step()
    assert callable(forward_step)
