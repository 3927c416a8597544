"""kit's rewrite of RETURNN's learning_rate_file keeps every row and ':meta:' entry RETURNN wrote, RETURNN's
own reader reads the result back, and the values in the file are checked like the config keys they stand for."""

from __future__ import annotations

import pytest

from kit.errors import ScoreFileError
from kit.scores import ScoreTable, parse_returnn_lr_file
from tests.returnn_compat.returnn_helpers import needs_returnn
from tests.returnn_compat.test_run_dir import LR_FILE, _session, make_returnn_run

EXTRA = """99999999999: EpochData(learningRate=0.5, error={
'dev_loss_ce': 0.1,
':meta:distributed': None,
':meta:note': 'far',
}),
}
"""


def _returnn_style_run(run_dir) -> str:
    make_returnn_run(run_dir)
    text = LR_FILE.rstrip().rstrip("}") + EXTRA
    text = text.replace("':meta:global_train_step': 6,",
                        "':meta:global_train_step': 6,\n':meta:distributed': None,\n':meta:ranks': [0, 1],")
    (run_dir / "learning_rates").write_text(text)
    return text


def test_every_row_and_meta_entry_survives_kits_rewrite(tmp_path):
    before = parse_returnn_lr_file(_returnn_style_run(tmp_path))["epochs"]
    with _session(tmp_path) as session:
        session.train()
    after = parse_returnn_lr_file((tmp_path / "learning_rates").read_text())["epochs"]
    for epoch, row in before.items():
        assert after[epoch] == row, epoch  # rows RETURNN wrote, kept exactly (epoch 3 is kit's new one)
    assert after[2]["meta"] == {"global_train_step": 6, "distributed": None, "ranks": [0, 1]}
    assert sorted(after) == [1, 2, 3, 99999999999]


@needs_returnn
def test_returnns_reader_reads_kits_rewrite(tmp_path):
    from returnn.learning_rate_control import LearningRateControl

    _returnn_style_run(tmp_path)
    with _session(tmp_path) as session:
        session.train()
    control = LearningRateControl(default_learning_rate=0.01, filename=str(tmp_path / "learning_rates"))
    data = control.epoch_data
    assert sorted(data) == [1, 2, 3, 99999999999]
    assert data[2].meta == {"global_train_step": 6, "distributed": None, "ranks": [0, 1]}
    assert data[99999999999].meta == {"distributed": None, "note": "far"}
    assert data[99999999999].error == {"dev_loss_ce": 0.1}
    assert data[3].learning_rate == 0.005 and set(data[3].error) == {"dev_loss_ce", "train_loss_ce"}


@pytest.mark.parametrize("lr", ["-0.01", "nan", "inf"])
def test_a_bad_learning_rate_in_the_file_is_refused_naming_file_and_epoch(tmp_path, lr):
    path = tmp_path / "learning_rates"
    path.write_text(LR_FILE.replace("2: EpochData(learningRate=0.01", f"2: EpochData(learningRate={lr}"))
    with pytest.raises(ScoreFileError, match=rf"learning_rates.*epoch 2: the learning rate is {lr.lstrip('-')}|"
                                             rf"learning_rates.*epoch 2: the learning rate is -0.01"):
        ScoreTable.load(path)
    path.write_text(LR_FILE)  # negative control
    assert ScoreTable.load(path).learning_rate(2) == 0.01


def test_a_negative_learning_rate_in_the_file_stops_the_run_before_training(tmp_path):
    make_returnn_run(tmp_path)
    text = LR_FILE.rstrip().rstrip("}") + "3: EpochData(learningRate=-0.01, error={}),\n}\n"
    (tmp_path / "learning_rates").write_text(text)
    with _session(tmp_path) as session, pytest.raises(ScoreFileError, match="epoch 3: the learning rate is -0.01"):
        session.train()
    assert not list(tmp_path.glob("model.003*"))
