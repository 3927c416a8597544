"""What the CLI prints: one number format, ``kit scores`` / ``kit checkpoints`` on any way to name a run,
and the closing summary of ``kit train``."""

from __future__ import annotations

import re

import pytest
from helpers.models import tiny_config

import kit
from kit import cli
from kit.cli_views import train_summary
from kit.scores import ScoreTable, format_value


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("run")
    session = kit.Session(tiny_config(model=str(folder / "model"), num_epochs=2))
    session.train()
    session.close()
    return str(folder)


def test_one_number_format_four_significant_digits() -> None:
    assert [format_value(v) for v in (0.0, 5.106e-4, 0.0023, 0.512345, 12345.0)] == [
        "0", "0.0005106", "0.0023", "0.5123", "1.234e+04"]


@pytest.mark.parametrize("how", ["folder", "folder/", "prefix", "score file"])
def test_scores_for_every_way_of_naming_a_run(run, how, capsys) -> None:
    what = {"folder": run, "folder/": run + "/", "prefix": f"{run}/model", "score file": f"{run}/model.scores.json"}[how]
    assert cli.main(["scores", what]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith("model.scores.json (2 epochs)")
    assert lines[1].split() == ["epoch", "lr", "train_loss_ce", "train_loss_fer", "dev_loss_ce", "dev_loss_fer"]
    assert [ln.split()[0] for ln in lines[2:4]] == ["1", "2"]  # epochs in order
    table = ScoreTable.load(f"{run}/model.scores.json")
    best = min((1, 2), key=lambda e: table.scores(e)["dev_loss_fer"])
    assert lines[1 + best].split()[5] == format_value(table.scores(best)["dev_loss_fer"]) + "*"
    assert "e+00" not in out and not re.search(r"\d\.\d{5,}", out)  # no long or 0.000e+00 numbers
    assert "* best (lowest) of dev_loss_ce, dev_loss_fer" in out


def test_checkpoints_show_sizes_verification_scores_and_best(run, capsys) -> None:
    assert cli.main(["checkpoints", run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r".*model: 2 checkpoints, [\d.]+ KiB", out[0])
    assert out[1].split() == ["name", "kind", "epoch", "step", "size", "verified", "dev_loss_ce", "dev_loss_fer"]
    rows = [ln.split() for ln in out[2:4]]
    assert [r[0] for r in rows] == ["model.001", "model.002"]
    assert all(r[5] == "KiB" and r[6] == "ok" for r in rows)  # size, verified
    assert sum(r[-2].endswith("*") for r in rows) == 1  # dev_loss_ce: one best epoch


def test_checkpoints_say_when_a_file_is_corrupt(run, tmp_path, capsys) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    with open(copy / "model.001.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0\0\0\0")
    assert cli.main(["checkpoints", str(copy)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:4]
    assert "CORRUPT" in rows[0] and " ok " in rows[1] + " "


def test_a_missing_run_is_one_clear_line(tmp_path, capsys) -> None:
    assert cli.main(["scores", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "no score file" in err and "Traceback" not in err


def test_closing_summary(run) -> None:
    table = ScoreTable.load(f"{run}/model.scores.json")
    text = train_summary(table, 1, f"{run}/model", 83.0)
    lines = text.splitlines()
    assert lines[0] == "trained epochs 1-2 (2 this run, 2 in all) in 1 min 23 s"
    best = min((1, 2), key=lambda e: table.scores(e)["dev_loss_fer"])
    assert lines[1] == f"best dev_loss_fer {format_value(table.scores(best)['dev_loss_fer'])} at epoch {best}"
    assert lines[2] == f"files: {run}/model.*.pt (checkpoints), {run}/model.scores.json (scores)"


def test_the_log_lines_sec_per_step_is_wall_clock_per_step(caplog) -> None:
    """What happens between steps (data, views, a slow handler) counts, as in a progress bar's rate."""
    import logging
    import time

    session = kit.Session(tiny_config(log_every_n_steps=4))
    session.on("step_end", lambda **_: time.sleep(0.05))  # 50 ms outside the step's own compute
    with caplog.at_level(logging.INFO, logger="kit"):
        session.train_steps(9)
    rates = [float(m.group(1)) for r in caplog.records
             if (m := re.search(r"step [48], .*, ([\d.e-]+) sec/step$", r.getMessage()))]
    assert len(rates) == 2 and all(rate >= 0.05 for rate in rates), rates  # the step's own seconds: a few ms
    steps = session.history["seconds"]
    assert steps.iloc[1:].max() < 0.05  # the control: the steps' own times leave the 50 ms out


def test_the_progress_bar_shows_the_same_wall_clock_rate() -> None:
    import io
    import time

    from kit.widgets.terminal import TerminalProgress

    session = kit.Session(tiny_config(), live=False)
    out = io.StringIO()
    TerminalProgress(session._parts.events, lambda: 3, file=out, min_interval=0.0)
    session.on("step_end", lambda **_: time.sleep(0.05))
    session.train_steps(6)
    rates = [float(r) for r in re.findall(r"([\d.e-]+) s/step", out.getvalue())]
    assert rates and all(rate >= 0.05 for rate in rates[1:]), rates
