"""The Engine around the step: device choice, seeding, eval and the score table, log lines,
counters, and two engines in one process."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from helpers.models import TinyModel, params_equal, tiny_config

import kit
from kit.data import Task12AXDataset
from kit.engine.device import select_device
from kit.engine.engine import Engine
from kit.run_ctx import current_run_ctx


def make_engine(**overrides) -> Engine:
    return Engine(kit.Config(tiny_config(None, **overrides)))


# ---- device ----------------------------------------------------------------------------


def test_device_none_picks_the_best_available_and_says_why(monkeypatch):
    monkeypatch.delenv("PT_DEVICE", raising=False)
    device, reason = select_device(None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        expected = "mps"
    assert device.type == expected and "device=None" in reason


@pytest.mark.parametrize("name", ["cpu", "meta"])
def test_device_given_is_used_as_given(monkeypatch, name):
    monkeypatch.delenv("PT_DEVICE", raising=False)
    device, reason = select_device(name)
    assert device == torch.device(name) and repr(name) in reason


def test_pt_device_env_var_overrides_the_config(monkeypatch):
    monkeypatch.setenv("PT_DEVICE", "meta")
    device, reason = select_device("gpu")  # would be an error without the override on a CPU machine
    assert device == torch.device("meta") and "PT_DEVICE" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU")
@pytest.mark.parametrize("name", ["gpu", "cuda", "cuda:1"])
def test_asking_for_a_gpu_without_one_says_why(monkeypatch, name):
    monkeypatch.delenv("PT_DEVICE", raising=False)
    with pytest.raises(kit.ConfigError) as info:
        select_device(name)
    text = str(info.value)
    assert "config key 'device'" in text and repr(name) in text
    assert "CPU-only build" in text or "is_available() is False" in text


def test_bad_device_name_is_a_config_error(monkeypatch):
    monkeypatch.delenv("PT_DEVICE", raising=False)
    with pytest.raises(kit.ConfigError, match="expected 'cpu', 'gpu'"):
        select_device("tpu-ish")


def test_engine_logs_its_device_with_the_reason(monkeypatch, caplog):
    monkeypatch.delenv("PT_DEVICE", raising=False)
    engine = make_engine(device="cpu")
    with caplog.at_level(logging.INFO, logger="kit"):
        engine.setup()
    assert engine.device == torch.device("cpu")
    assert next(p for p in engine.model.parameters()).device == torch.device("cpu")
    assert "device: cpu (device='cpu' in the config)" in caplog.text


# ---- seeding -----------------------------------------------------------------------------


def test_get_model_is_seeded_from_random_seed_not_from_process_history():
    a = make_engine()
    a.setup()
    torch.rand(1000)  # process history between the two must not matter
    b = make_engine()
    b.setup()
    c = make_engine(random_seed=7)
    c.setup()
    assert params_equal(a.model, b.model)
    assert not params_equal(a.model, c.model)


def test_each_epoch_is_reseeded_so_randomness_does_not_depend_on_history():
    # dropout 0.5: epoch 2's masks come from (random_seed, epoch, global step) alone
    def run(noise: bool) -> torch.nn.Module:
        engine = make_engine(
            get_model=lambda **_: TinyModel(dropout=0.5),
            num_epochs=2,
            dev=None,
            train=Task12AXDataset(40, seed=1),
        )
        engine.train_epoch()
        if noise:
            torch.rand(1000)
        engine.train_epoch()
        return engine.model

    quiet, noisy = run(False), run(True)
    assert params_equal(quiet, noisy)


# ---- counters and step results -------------------------------------------------------------


def test_counters_and_step_results_over_epochs():
    engine = make_engine(num_epochs=2, accum_grad_multiple_step=2, dev=None)
    results = []
    engine.events.on("step_end", lambda result: results.append(result))
    assert engine.train()
    ep1 = [r for r in results if r.epoch == 1]
    ep2 = [r for r in results if r.epoch == 2]
    assert [r.step for r in ep1] == list(range(len(ep1))) and [r.step for r in ep2] == list(range(len(ep2)))
    assert [r.global_train_step for r in results] == list(range(len(results)))
    assert engine.progress.global_train_step == len(results)
    # one update per 2 micro-batches; an odd epoch's last window is applied at the epoch end
    assert engine.progress.num_updates == math.ceil(len(ep1) / 2) + math.ceil(len(ep2) / 2)
    assert sum(r.num_seqs for r in ep1) == 120 and ep1[-1].complete_frac == pytest.approx(1.0)
    assert engine.scores.meta(1)["epoch_num_train_steps"] == len(ep1)
    assert engine.scores.meta(2)["global_train_step"] == len(ep1)  # RETURNN's meaning: the epoch's start
    assert engine.scores.meta(2)["global_train_step_end"] == len(results)


def test_train_step_returns_none_at_the_epoch_end_and_the_epoch_must_be_finished():
    engine = make_engine(train=Task12AXDataset(20, seed=1), dev=None)
    n = 0
    while engine.train_step() is not None:
        n += 1
    assert engine.train_step() is None and engine.progress.epoch == 1 and n > 0
    row = engine.finish_epoch()
    assert engine.progress.epoch == 2 and "train_loss_ce" in row
    assert engine.train_step().epoch == 2


# ---- eval and the score table ----------------------------------------------------------------


def test_eval_results_are_named_per_dataset_and_recorded(tmp_path):
    engine = Engine(
        kit.Config(
            tiny_config(
                str(tmp_path / "model"),
                num_epochs=1,
                eval=Task12AXDataset(10, seed=3),
                eval_datasets={"other": Task12AXDataset(12, seed=4)},
            )
        )
    )
    results = engine.eval_model()
    assert set(results) == {"dev", "eval", "other"}
    assert set(results["other"]) == {"other_loss_ce", "other_loss_fer"}
    engine.train()
    row = engine.epoch_scores(1)
    for name in ("train", "dev", "eval", "other"):
        assert 0 <= row[f"{name}_loss_fer"] <= 1 and row[f"{name}_loss_ce"] > 0
    assert row["learning_rate"] == pytest.approx(1e-2)
    table = kit.ScoreTable.load(tmp_path / "model.scores.json")
    assert {"train_loss_fer", "dev_loss_fer", "other_loss_fer"} <= table.error_keys
    assert "dev_loss_ce" not in table.error_keys
    df = table.to_pandas()
    assert list(df.index) == [1] and df.index.name == "epoch"
    assert df.loc[1, "other_loss_ce"] == pytest.approx(row["other_loss_ce"])
    meta = table.meta(1)
    for key in (
        "global_train_step",
        "epoch_num_train_steps",
        "epoch_train_time_secs",
        "device",
        "torch_version",
        "kit_version",
        "hostname",
        "time",
    ):
        assert key in meta, key


def test_eval_uses_train_step_without_grad_and_train_flag_false():
    seen = []

    def train_step(*, model, extern_data, **_kwargs):
        ctx = kit.get_run_ctx()
        seen.append((ctx.stage, ctx.train_flag, torch.is_grad_enabled(), model.training))
        out = model(extern_data["data"].tensor)
        ctx.mark_as_loss(out.sum(), "s")

    engine = make_engine(train_step=train_step, dev=Task12AXDataset(5, seed=2))
    engine.train_step()
    engine.eval_model()
    assert seen[0] == ("train", True, True, True)
    assert seen[1:] == [("eval", False, False, False)]
    assert engine.model.training  # back in train mode for the next step


@pytest.mark.parametrize("in_eval", [True, False])
def test_eval_chunks_as_returnns_torch_engine_unless_turned_off(in_eval):
    lengths = []

    def train_step(*, model, extern_data, **_kwargs):
        lengths.extend(extern_data["data"].lengths.tolist())
        kit.get_run_ctx().mark_as_loss(model(extern_data["data"].tensor).sum(), "s")

    dev = Task12AXDataset(6, seed=2)
    engine = make_engine(train_step=train_step, dev=dev, chunking=5, **({} if in_eval else {"chunking_in_eval": False}))
    engine.eval_model()
    whole = sorted(dev.get_seq_length(i)["data"] for i in range(6))
    if in_eval:  # RETURNN's torch engine chunks every loader, eval included (the default)
        assert max(lengths) <= 5 and sum(lengths) == sum(whole)
    else:
        assert sorted(lengths) == whole
    lengths.clear()
    engine.train_step()
    assert max(lengths) <= 5


@pytest.mark.parametrize(
    "keys, fragment",
    [
        ({"dev": Task12AXDataset(0)}, "is empty"),
        ({"dev": Task12AXDataset(5), "max_seq_length": 3}, "were removed by"),
    ],
    ids=["no-seqs", "all-filtered"],
)
def test_empty_eval_dataset_is_a_clear_error_naming_it(keys, fragment):
    engine = make_engine(**keys)
    with pytest.raises(kit.DataError) as info:
        engine.eval_model()
    assert str(info.value).startswith("eval dataset 'dev'") and fragment in str(info.value)


# ---- log lines ----------------------------------------------------------------------------------


def test_step_log_lines_in_returnns_shape_at_the_interval(caplog):
    engine = make_engine(log_every_n_steps=2, train=Task12AXDataset(40, seed=1))
    with caplog.at_level(logging.INFO, logger="kit"):
        engine.train_epoch()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ep 1 train")]
    assert lines and all(
        re.fullmatch(
            r"ep 1 train, step \d*[02468], ce \d\.\d{1,4}, fer (0|\d\.\d{1,4}(e-\d+)?), "
            r"\d[\d.e-]* sec/step",  # 4 significant digits (kit.scores.format_value)
            line,
        )
        for line in lines
    ), lines
    assert any(r.getMessage().startswith("finished epoch 1: ") for r in caplog.records)


# ---- two engines in one process ---------------------------------------------------------------


def _named_step(name: str):
    def train_step(*, model, extern_data, **_kwargs):
        ctx = kit.get_run_ctx()
        assert not ctx.losses  # a fresh context: nothing from the other engine's step
        logits = model(extern_data["data"].tensor)
        ce = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), extern_data["classes"].tensor, reduction="none"
        )
        ctx.mark_as_loss(ce, name, mask=extern_data["classes"].mask())

    return train_step


def test_two_engines_stepped_in_turns_do_not_see_each_others_losses():
    def engine(name: str, seed: int) -> Engine:
        return make_engine(
            train_step=_named_step(name),
            random_seed=seed,
            dev=None,
            get_model=lambda **_: TinyModel(dropout=0.0),
        )

    a, b = engine("a", 1), engine("b", 2)
    alone_a = [r.losses for r in iter(a.train_step, None)]
    alone_b = [r.losses for r in iter(b.train_step, None)]
    a, b = engine("a", 1), engine("b", 2)
    turns_a, turns_b = [], []
    for i in range(max(len(alone_a), len(alone_b))):
        if i < len(alone_a):
            turns_a.append(a.train_step().losses)
        assert current_run_ctx() is None  # installed only for the duration of a step
        if i < len(alone_b):
            turns_b.append(b.train_step().losses)
    assert turns_a == alone_a and turns_b == alone_b
    assert all(set(x) == {"a"} for x in turns_a) and all(set(x) == {"b"} for x in turns_b)
    assert a.finish_epoch()["train_loss_a"] > 0 and "train_loss_a" not in b.finish_epoch()


def test_get_run_ctx_outside_a_step_is_an_error():
    make_engine().train_step()
    with pytest.raises(RuntimeError, match="only available inside"):
        kit.get_run_ctx()


# ---- the Session drives the same engine ------------------------------------------------------


def test_session_train_epoch_gives_the_engines_score_row():
    cfg = tiny_config(None, num_epochs=1, get_model=lambda **_: TinyModel(dropout=0.0))
    with kit.Session(cfg) as session:
        first = session.train_step()
        row = session.train_epoch()
        df = session.scores
    engine = Engine(kit.Config(cfg))
    engine_row = engine.train_epoch()
    assert first.last_step.global_train_step == 0
    assert row["train_loss_ce"] == pytest.approx(engine_row["train_loss_ce"], rel=1e-9)
    assert row["dev_loss_fer"] == pytest.approx(engine_row["dev_loss_fer"], rel=1e-9)
    assert df.loc[1, "train_loss_ce"] == pytest.approx(row["train_loss_ce"])
