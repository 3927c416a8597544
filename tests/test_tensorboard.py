"""``use_tensorboard`` / ``tensorboard_opts``: event files from a Session and from the CLI, read back."""

from __future__ import annotations

import math

import pytest

import kit
from kit.cli import main
from tests.helpers.models import tiny_config

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed (CI installs it)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_session_writes_step_losses_learning_rate_and_every_epoch_score(tmp_path):
    prefix = tmp_path / "run" / "model"
    session = kit.Session(**tiny_config(str(prefix), num_epochs=2, use_tensorboard=True,
                                        tensorboard_opts={"log_every_n_train_steps": 3}))
    steps = []
    session.on("step_end", lambda result, **_: steps.append((result.global_train_step, result.losses)))
    session.train()
    table = session.score_table
    session.close()
    tags = _scalars(f"{prefix}.tensorboard")  # the default log dir: beside the checkpoints
    logged = [(g, losses) for g, losses in steps if g % 3 == 0]
    assert [s for s, _ in tags["train/ce"]] == [g for g, _ in logged]
    for (step, value), (_, losses) in zip(tags["train/ce"], logged):
        assert math.isclose(value, losses["ce"], rel_tol=1e-6), step  # event files store float32
    assert [s for s, _ in tags["train/learning_rate"]] == [g for g, _ in logged]
    assert all(math.isclose(v, 1e-2, rel_tol=1e-6) for _, v in tags["train/learning_rate"])
    for epoch_index, epoch in enumerate(table.epochs):
        for key, value in table.scores(epoch).items():
            dataset, name = kit.scores.split_score_key(key)
            tag = f"train_epoch/{name}" if dataset == "train" else f"{dataset}/{name}"
            assert math.isclose(tags[tag][epoch_index][1], value, rel_tol=1e-6), (tag, epoch)
    assert {"dev/ce", "dev/fer", "train_epoch/ce", "train_epoch/fer", "train_epoch/learning_rate"} <= set(tags)
    # epoch scalars sit at the global train step of the epoch end, so they line up with the step curves
    assert [s for s, _ in tags["dev/ce"]] == [table.meta(e)["global_train_step_end"] for e in table.epochs]


def test_cli_writes_to_the_configured_log_dir(tmp_path, capsys):
    from tests.test_cli import CONFIG

    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG)
    log_dir = tmp_path / "tb"
    rc = main(["-q", "train", str(cfg), "num_epochs=1", f"model={tmp_path / 'model'}", "use_tensorboard=True",
               f"tensorboard_opts={{'log_dir': {str(log_dir)!r}, 'log_every_n_train_steps': 1}}"])
    assert rc == 0, capsys.readouterr().err
    tags = _scalars(log_dir)
    assert {"train/ce", "train/fer", "train/learning_rate", "dev/ce", "dev/fer", "train_epoch/ce"} <= set(tags)
    table = kit.ScoreTable.load(f"{tmp_path / 'model'}.scores.json")
    assert math.isclose(tags["dev/ce"][-1][1], table.scores(1)["dev_loss_ce"], rel_tol=1e-6)
    assert len(tags["train/ce"]) == table.meta(1)["epoch_num_train_steps"]  # every step


def test_off_by_default_writes_nothing(tmp_path):
    prefix = tmp_path / "model"
    session = kit.Session(**tiny_config(str(prefix), num_epochs=1))
    session.train_steps(2)
    session.close()
    assert not (tmp_path / "model.tensorboard").exists()


@pytest.mark.parametrize("opts, word", [({"log_every": 3}, "log_every"), ({"log_every_n_train_steps": 0}, "positive"),
                                        ("runs", "dict")])
def test_bad_tensorboard_opts_name_the_key(opts, word):
    with pytest.raises(kit.ConfigError, match=f"tensorboard_opts.*{word}"):
        kit.Config(tiny_config(use_tensorboard=True, tensorboard_opts=opts))
