"""LearningRateControl: RETURNN's constant / newbob / newbob_abs / newbob_multi_epoch sequences."""

from __future__ import annotations

import logging

import pytest

from kit.config import Config
from kit.engine.lr_control import LearningRateControl, make_lr_control
from kit.errors import ConfigError
from kit.scores import ScoreTable


def run(config: dict, dev_scores: list[float], key: str = "dev_loss_ce", **extra_scores) -> list[float]:
    """Simulate training: lr for each epoch, then that epoch's score; returns the lrs (one more than scores)."""
    config.setdefault("learning_rate_control_error_measure", key)
    table = ScoreTable()
    control = make_lr_control(Config(**config), table)
    lrs = []
    for epoch, score in enumerate(dev_scores, start=1):
        lrs.append(control.learning_rate_for_epoch(epoch))
        table.set_scores(epoch, {key: score, **{k: v[epoch - 1] for k, v in extra_scores.items()}})
    lrs.append(control.learning_rate_for_epoch(len(dev_scores) + 1))
    return lrs


def test_constant():
    assert run({"learning_rate": 0.1}, [3.0, 2.0, 2.5]) == [0.1] * 4


def test_learning_rates_list_then_last_value_stays():
    lrs = run({"learning_rate": 1.0, "learning_rates": [0.1, 0.2, 0.3]}, [1.0] * 4)
    assert lrs == [0.1, 0.2, 0.3, 0.3, 0.3]


def test_learning_rates_dict_holds_from_that_epoch_on():
    lrs = run({"learning_rate": 1.0, "learning_rates": {1: 0.1, 3: 0.01}}, [1.0] * 4)
    assert lrs == [0.1, 0.1, 0.01, 0.01, 0.01]


def test_learning_rates_string_is_never_evaluated():
    with pytest.raises(ConfigError, match="learning_rates"):
        Config(learning_rates="[__import__('os').getpid()]")


def test_newbob_decays_when_relative_improvement_is_too_small():
    # relative change (new-old)/|new|: epoch2: (0.9-1)/0.9=-0.11 (good), epoch3: (0.895-0.9)/0.895=-0.0056 > -0.01
    lrs = run({"learning_rate": 1.0, "learning_rate_control": "newbob"}, [1.0, 0.9, 0.895, 0.5])
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.5]


def test_newbob_grows_with_learning_rate_growth():
    lrs = run(
        {"learning_rate": 1.0, "learning_rate_control": "newbob_rel", "learning_rate_growth": 1.5},
        [1.0, 0.5, 0.2],
    )
    assert lrs == [1.0, 1.0, 1.5, 2.25]


def test_newbob_threshold_and_decay_keys():
    config = {
        "learning_rate": 1.0,
        "learning_rate_control": "newbob",
        "newbob_relative_error_threshold": -0.5,
        "newbob_learning_rate_decay": 0.1,
    }
    assert run(config, [1.0, 0.9, 0.8]) == pytest.approx([1.0, 1.0, 0.1, 0.01])
    config["learning_rate_decay"] = 0.3  # learning_rate_decay wins over the newbob_ alias
    assert run(config, [1.0, 0.9]) == pytest.approx([1.0, 1.0, 0.3])


def test_newbob_min_learning_rate_floor():
    lrs = run(
        {"learning_rate": 1.0, "learning_rate_control": "newbob", "min_learning_rate": 0.3},
        [1.0, 1.0, 1.0, 1.0],
    )
    assert lrs == [1.0, 1.0, 0.5, 0.3, 0.3]


def test_newbob_relative_error_relative_lr():
    # at lr 0.5 (of 1.0) a relative change of -0.008 counts as -0.016 (< -0.01): no decay
    config = {
        "learning_rate": 1.0,
        "learning_rate_control": "newbob",
        "learning_rate_control_relative_error_relative_lr": True,
        "learning_rates": [1.0, 0.5, 0.5],
    }
    scores = [1.0, 1.0, 1 / 1.008]
    assert run(config, scores)[-1] == 0.5
    config["learning_rate_control_relative_error_relative_lr"] = False
    assert run(config, scores)[-1] == 0.25


def test_newbob_abs():
    lrs = run(
        {"learning_rate": 1.0, "learning_rate_control": "newbob_abs", "newbob_error_threshold": -0.05},
        [1.0, 0.9, 0.88, 0.7],
    )
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.5]


def test_newbob_multi_epoch_checks_every_interval_on_the_mean():
    config = {
        "learning_rate": 1.0,
        "learning_rate_control": "newbob_multi_epoch",
        "newbob_multi_num_epochs": 2,
        "newbob_multi_update_interval": 2,
    }
    # checks at epochs 3, 5, 7, 9 (epoch % 2 == 1) on the mean rel. change over the last 2 diffs:
    # ep5: mean(-1/3, 0) improves enough; ep7: mean(0, 0) → decay; ep8 is no check epoch; ep9 → decay
    scores = [1.0, 0.8, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    lrs = run(config, scores)
    assert lrs == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    plain = run({"learning_rate": 1.0, "learning_rate_control": "newbob"}, scores)
    assert plain[-3:] == [0.125, 0.0625, 0.03125]  # newbob_rel decays every flat epoch


def test_min_num_epochs_per_new_lr_keeps_a_new_lr():
    base = {"learning_rate": 1.0, "learning_rate_control": "newbob"}
    flat = [1.0] * 6
    assert run(dict(base), flat) == [1.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]
    kept = run(dict(base, learning_rate_control_min_num_epochs_per_new_lr=3), flat)
    assert kept == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]


def test_stored_lr_wins_and_survives_a_restart(tmp_path):
    path = tmp_path / "scores.json"
    config = Config(
        learning_rate=1.0, learning_rate_control="newbob", learning_rate_control_error_measure="dev_loss_ce"
    )
    table = ScoreTable(path)
    control = LearningRateControl(config, table)
    for epoch, score in enumerate([1.0, 1.0, 1.0], start=1):
        control.learning_rate_for_epoch(epoch)
        table.set_scores(epoch, {"dev_loss_ce": score})
    table.save()
    fresh = make_lr_control(config, ScoreTable.load(path))
    assert [fresh.learning_rate_for_epoch(e) for e in (1, 2, 3, 4)] == [1.0, 1.0, 0.5, 0.25]
    table.set_learning_rate(3, 0.7)  # a stored lr is returned as stored
    assert control.learning_rate_for_epoch(3) == 0.7


def test_legacy_returnn_table_picks_dev_score(caplog):
    table = ScoreTable()
    for epoch, (err, score) in enumerate([(0.3, 1.0), (0.3, 1.0)], start=1):
        table.set_learning_rate(epoch, 1.0)
        table.set_scores(epoch, {"dev_error": err, "dev_score": score, "train_score": 2.0})
    control = make_lr_control(Config(learning_rate=1.0, learning_rate_control="newbob"), table)
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert control.learning_rate_for_epoch(3) == 0.5
    assert control.error_key(1) == "dev_score"


def test_newbob_warns_naming_the_measure_it_picked(caplog):
    table = ScoreTable()
    control = make_lr_control(Config(learning_rate=1.0, learning_rate_control="newbob"), table)
    for epoch in (1, 2):
        control.learning_rate_for_epoch(epoch)
        table.set_scores(
            epoch, {"train_loss_ce": 1.0, "dev_loss_fer": 0.2, "dev_loss_ce": 1.0}, errors={"dev_loss_fer"}
        )
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert control.learning_rate_for_epoch(3) == 0.5
    warnings = [r for r in caplog.records if r.name == "kit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'dev_loss_ce'" in warnings[0].getMessage()
    assert "learning_rate_control_error_measure" in warnings[0].getMessage()


def test_no_warning_with_explicit_measure_or_constant(caplog):
    with caplog.at_level(logging.WARNING, logger="kit"):
        run({"learning_rate": 1.0, "learning_rate_control": "newbob"}, [1.0, 1.0])
        table = ScoreTable()
        control = make_lr_control(Config(learning_rate=1.0), table)
        control.learning_rate_for_epoch(1)
        table.set_scores(1, {"dev_loss_ce": 1.0})
        control.learning_rate_for_epoch(2)
    assert not [r for r in caplog.records if r.name == "kit"]


def test_explicit_measure_missing_from_scores_is_a_config_error():
    with pytest.raises(ConfigError, match="learning_rate_control_error_measure.*dev_loss_xyz"):
        run(
            {
                "learning_rate": 1.0,
                "learning_rate_control": "newbob",
                "learning_rate_control_error_measure": "dev_loss_xyz",
            },
            [1.0, 1.0],
        )


def test_dynamic_learning_rate_gets_its_arguments():
    calls = []

    def dyn(*, global_train_step, epoch, epoch_continuous, learning_rate, **kwargs):
        calls.append((global_train_step, epoch, epoch_continuous, learning_rate))
        return learning_rate * min(1.0, (global_train_step + 1) / 10)

    control = make_lr_control(Config(learning_rate=0.5, dynamic_learning_rate=dyn), ScoreTable())
    lr = control.dynamic_learning_rate(global_train_step=4, epoch=2, epoch_continuous=1.25, learning_rate=0.5)
    assert lr == pytest.approx(0.25) and isinstance(lr, float)
    assert calls == [(4, 2, 1.25, 0.5)]


def test_dynamic_learning_rate_unset_returns_the_epoch_lr():
    control = make_lr_control(Config(learning_rate=0.5), ScoreTable())
    assert (
        control.dynamic_learning_rate(global_train_step=9, epoch=1, epoch_continuous=0.5, learning_rate=0.3)
        == 0.3
    )


def test_dynamic_learning_rate_without_kwargs_is_a_type_error():
    def dyn(*, global_train_step, epoch, epoch_continuous, learning_rate):
        return learning_rate

    control = make_lr_control(Config(learning_rate=0.5, dynamic_learning_rate=dyn), ScoreTable())
    with pytest.raises(TypeError, match=r"\*\*kwargs"):
        control.dynamic_learning_rate(global_train_step=0, epoch=1, epoch_continuous=0.0, learning_rate=0.5)


def test_state_dict_round_trip():
    control = make_lr_control(Config(learning_rate_control="newbob_abs"), ScoreTable())
    other = make_lr_control(Config(learning_rate_control="newbob_abs"), ScoreTable())
    other.load_state_dict(control.state_dict())
    assert other.kind == control.kind == "newbob_abs"
