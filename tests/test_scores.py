"""ScoreTable: rows, atomic JSON round trip with NaN, RETURNN's legacy file (parsed, never run), views."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from kit.scores import ScoreFileError, ScoreTable, format_epoch_summary, format_step_line

LEGACY = """{1: EpochData(learningRate=0.001, error={
'dev_error': 0.31, 'dev_score': 0.5, 'train_score': 0.6, ':meta:effective_learning_rate': 0.001}),
 2: EpochData(learningRate=0.001, error={'dev_score': nan, 'train_score': inf, 'dev_error': -inf}),
 3: EpochData(learningRate=0.0005, error={}),
}
"""


def filled_table(path=None) -> ScoreTable:
    table = ScoreTable(path)
    table.set_learning_rate(1, 1e-3)
    table.set_scores(1, {"train_loss_ce": 2.5, "train_loss_fer": 0.5}, errors={"train_loss_fer"})
    table.set_scores(1, {"dev_loss_ce": 2.0, "dev_loss_fer": 0.4}, errors=["dev_loss_fer"])
    table.set_meta(1, global_train_step=100, hostname="box", peak_memory={"cuda": 123})
    table.set_learning_rate(2, 5e-4)
    table.set_scores(2, {"train_loss_ce": float("nan"), "dev_loss_ce": float("inf")})
    return table


def test_rows_and_accessors():
    table = filled_table()
    assert table.epochs == [1, 2]
    assert table.learning_rate(1) == 1e-3 and table.learning_rate(3) is None
    assert table.scores(1) == {
        "train_loss_ce": 2.5,
        "train_loss_fer": 0.5,
        "dev_loss_ce": 2.0,
        "dev_loss_fer": 0.4,
    }
    assert table.error_keys == {"train_loss_fer", "dev_loss_fer"}
    assert table.meta(1)["hostname"] == "box"
    assert table.row(1)["learning_rate"] == 1e-3
    with pytest.raises(KeyError):
        table.row(7)
    assert table.has_scores(1, "dev_") and not table.has_scores(3) and table.has_scores(2)
    assert not table.has_scores(2, "eval_")


def test_set_scores_refuses_errors_that_are_not_scores():
    with pytest.raises(ValueError, match="not among the scores"):
        ScoreTable().set_scores(1, {"dev_loss_ce": 1.0}, errors={"dev_loss_fer"})


def test_remove_epochs_after():
    table = filled_table()
    table.set_learning_rate(3, 1e-4)
    assert table.remove_epochs_after(1) == [2, 3]
    assert table.epochs == [1]


def test_best_epochs_skips_nan_and_missing():
    table = ScoreTable()
    for epoch, value in [(1, 0.5), (2, 0.3), (3, float("nan")), (4, 0.4)]:
        table.set_scores(epoch, {"dev_loss_ce": value})
    table.set_learning_rate(5, 1.0)
    assert table.best_epochs("dev_loss_ce", 2) == [2, 4]
    assert table.best_epochs("dev_loss_ce", 5, lower_is_better=False) == [1, 4, 2]


def test_save_load_round_trip_with_nan_and_inf(tmp_path):
    path = tmp_path / "sub" / "model.scores.json"
    table = filled_table(path)
    assert table.save() == str(path)
    loaded = ScoreTable.load(path)
    assert loaded.path == str(path)
    assert loaded.epochs == [1, 2]
    assert loaded.scores(1) == table.scores(1)
    assert math.isnan(loaded.scores(2)["train_loss_ce"]) and loaded.scores(2)["dev_loss_ce"] == math.inf
    assert loaded.error_keys == table.error_keys
    assert loaded.meta(1) == {"global_train_step": 100, "hostname": "box", "peak_memory": {"cuda": 123}}
    assert loaded.learning_rate(2) == 5e-4
    assert not [n for n in os.listdir(path.parent) if n != "model.scores.json"]  # no temp files left


def test_save_is_atomic_old_file_survives_a_failed_write(tmp_path, monkeypatch):
    path = tmp_path / "scores.json"
    table = filled_table(path)
    table.save()
    before = path.read_text()
    table.set_learning_rate(3, 1e-5)

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        table.save()
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["scores.json"]


def test_save_without_path_is_an_error():
    with pytest.raises(Exception, match="no path"):
        ScoreTable().save()


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        ScoreTable.load(tmp_path / "nope.json")
    table = ScoreTable.load(tmp_path / "nope.json", missing_ok=True)
    assert table.epochs == [] and table.path == str(tmp_path / "nope.json")


def test_state_dict_round_trip():
    table = filled_table()
    other = ScoreTable()
    other.load_state_dict(table.state_dict())
    assert other.scores(1) == table.scores(1) and other.error_keys == table.error_keys
    assert other.meta(1) == table.meta(1)


def test_legacy_returnn_file_is_parsed(tmp_path):
    path = tmp_path / "newbob.data"
    path.write_text(LEGACY)
    table = ScoreTable.load(path)
    assert table.epochs == [1, 2, 3]
    assert table.learning_rate(3) == 0.0005
    assert table.scores(1) == {"dev_error": 0.31, "dev_score": 0.5, "train_score": 0.6}
    assert table.meta(1) == {"effective_learning_rate": 0.001}
    assert math.isnan(table.scores(2)["dev_score"]) and table.scores(2)["dev_error"] == -math.inf
    table.save()  # converted to kit JSON on save
    assert ScoreTable.load(path).scores(1) == table.scores(1)


@pytest.mark.parametrize(
    "payload",
    [
        "{1: EpochData(learningRate=__import__('os').system('touch {marker}'), error={})}",
        "__import__('os').system('touch {marker}')",
        "{1: __import__('os').system('touch {marker}')}",
        "{1: EpochData(learningRate=0.1, error={'x': open('{marker}', 'w')})}",
    ],
)
def test_malicious_legacy_file_is_refused_never_run(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.data"
    path.write_text(payload.replace("{marker}", str(marker)))
    with pytest.raises(ScoreFileError, match="refused|neither"):
        ScoreTable.load(path)
    assert not marker.exists()


def test_foreign_json_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ScoreFileError, match="not a kit score table"):
        ScoreTable.load(path)


def test_to_pandas_columns_and_index():
    pd = pytest.importorskip("pandas")
    frame = filled_table().to_pandas()
    assert isinstance(frame, pd.DataFrame)
    assert frame.index.name == "epoch" and list(frame.index) == [1, 2]
    assert list(frame.columns[:5]) == [
        "learning_rate",
        "train_loss_ce",
        "train_loss_fer",
        "dev_loss_ce",
        "dev_loss_fer",
    ]
    assert {"global_train_step", "hostname", "peak_memory"} <= set(frame.columns)
    assert frame.loc[1, "dev_loss_fer"] == 0.4 and math.isnan(frame.loc[2, "dev_loss_fer"])
    assert frame.loc[2, "learning_rate"] == 5e-4


def test_reprs():
    table = filled_table()
    text = repr(table)
    assert "ep 1: lr 0.001," in text and "dev_loss_ce 2," in text and "ep 2: lr 0.0005," in text
    pytest.importorskip("pandas")
    assert "<table" in table._repr_html_() and "dev_loss_ce" in table._repr_html_()


def test_import_kit_scores_does_not_import_pandas():
    code = "import sys, kit, kit.scores; kit.ScoreTable().set_learning_rate(1, 0.1); print('pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_step_line_has_returnns_shape():
    line = format_step_line(3, 17, {"ce": 0.5123, "fer": 0.12}, 0.0812)
    assert line == "ep 3 train, step 17, ce 0.5123, fer 0.12, 0.0812 sec/step"  # 4 significant digits
    assert format_step_line(1, 0, {"ce": 12345.0}, None, stage="dev") == "ep 1 dev, step 0, ce 1.234e+04"
    assert format_step_line(1, 0, {"fer": 0.0, "ce": 5.106e-4}) == "ep 1 train, step 0, fer 0, ce 0.0005106"


def test_epoch_summary_groups_by_dataset():
    line = format_epoch_summary(
        3,
        {"train_loss_ce": 0.5, "train_loss_fer": 0.1, "dev_loss_ce": 0.6},
        error_keys={"train_loss_fer"},
        learning_rate=1e-3,
    )
    assert line == "ep 3, lr 0.001, train: score ce 0.5 error fer 0.1, dev: score ce 0.6"


# ---- corrupt files: always a ScoreFileError naming the file and what is wrong ---------------------------

_KIT = '{"format": "kit-scores", "version": 1, "error_keys": [], "epochs": %s}'


def _kit(epochs: str) -> bytes:
    return (_KIT % epochs).encode()


CORRUPT_SCORE_FILES = {
    "JSON nested 100k deep": (_kit("[" * 100_000), "nested too deeply"),
    "legacy nested 100k deep": (b"{1: EpochData(learningRate=0.1, error=" + b"[" * 100_000, "nested deeper"),
    "non-UTF-8 byte": (LEGACY.encode().replace(b"dev_score", b"dev_sc\xffore"), "not UTF-8 text"),
    "JSON lr a string": (_kit('{"1": {"learning_rate": "0.1", "scores": {}}}'), "learning rate is '0.1'"),
    "legacy lr a string": (b"{1: EpochData(learningRate='fast', error={})}", "learning rate is 'fast'"),
    "JSON lr of 400 digits": (_kit('{"1": {"learning_rate": 1%s}}' % ("0" * 399)), "400 digits"),
    "legacy lr of 400 digits": (b"{1: EpochData(learningRate=1%s, error={})}" % (b"0" * 399), "400 digits"),
    "legacy number of 5000 digits": (b"{1: EpochData(learningRate=1%s)}" % (b"0" * 5000), "not readable"),
    "legacy complex number": (b"{1: EpochData(learningRate=1j)}", "not a number"),
    "JSON row a list": (_kit('{"1": [0.1, {}]}'), "the row is a list"),
    "JSON epochs a list": (_kit('[{"learning_rate": 0.1}]'), "'epochs' is a list"),
    "JSON scores a list": (_kit('{"1": {"scores": [1, 2]}}'), "scores is a list"),
    "JSON score a string": (_kit('{"1": {"scores": {"dev": "x"}}}'), "score 'dev' is 'x'"),
    "JSON epoch key a word": (_kit('{"one": {}}'), "not an epoch number"),
    "JSON error_keys a number": (b'{"format": "kit-scores", "error_keys": 3, "epochs": {}}', "'error_keys' is 3"),
    "JSON version a string": (b'{"format": "kit-scores", "version": "1", "epochs": {}}', "version is '1'"),
    "legacy error a list": (b"{1: EpochData(learningRate=0.1, error=[1])}", "error must be a dict"),
    "legacy unterminated": (b"{1: EpochData(learningRate=0.1, error={'a': 1}", "expected ','"),
    "legacy text after the table": (b"{1: EpochData(learningRate=0.1)} import os", "after the closing brace"),
    "legacy dict key a list": (b"{1: EpochData(error={[1]: 2})}", "key cannot be a list"),
    "truncated JSON": (_kit('{"1": {"learning_rate": 0.'), "invalid JSON at line 1"),
}
_SCORE_TALLY = {"tried": 0, "named": 0}


@pytest.mark.parametrize("case", list(CORRUPT_SCORE_FILES))
def test_a_corrupt_score_file_is_a_score_file_error_naming_it(tmp_path, case):
    import kit

    data, expected = CORRUPT_SCORE_FILES[case]
    path = tmp_path / "model.scores.json"
    path.write_bytes(data)
    _SCORE_TALLY["tried"] += 1
    with pytest.raises(kit.ScoreFileError) as info:
        ScoreTable.load(path)
    assert str(path) in str(info.value) and expected in str(info.value), str(info.value)[:300]
    assert len(str(info.value)) < 500
    _SCORE_TALLY["named"] += 1
    print(f"\ncorrupt score files: {_SCORE_TALLY['named']} named errors / {_SCORE_TALLY['tried']} tried")


def test_a_score_file_that_is_a_fifo_does_not_block(tmp_path):
    path = tmp_path / "scores.json"
    os.mkfifo(path)
    with pytest.raises(ScoreFileError, match="not a regular file"):
        ScoreTable.load(path)


def test_score_file_error_is_public_and_a_kit_error():
    import kit
    import kit.errors

    assert kit.ScoreFileError is kit.errors.ScoreFileError is ScoreFileError
    assert issubclass(ScoreFileError, kit.KitError)


def test_the_legacy_parser_reads_what_ast_reads():
    """Negative control for the hand-written parser: strings with escapes, tuples, signs, nested meta."""
    from kit.scores import parse_returnn_lr_file

    text = ("{\n  1: EpochData(learningRate=1e-3, error={'dev_score': -0.5, 'a\\'b': +2, \"x\": 1_000,\n"
            "  ':meta:shape': (1, 2), ':meta:one': (3,), ':meta:nested': {'k': [None, True, -inf]}}),\n"
            "  2: EpochData(learningRate=.5, error=0.25),  # old format\n}")
    state = parse_returnn_lr_file(text)
    assert state["epochs"][1] == {"learning_rate": 1e-3, "scores": {"dev_score": -0.5, "a'b": 2, "x": 1000},
                                  "meta": {"shape": (1, 2), "one": (3,), "nested": {"k": [None, True, -math.inf]}}}
    assert state["epochs"][2] == {"learning_rate": 0.5, "scores": {"old_format_score": 0.25}, "meta": {}}


def test_the_fast_row_path_gives_what_the_general_parser_gives(monkeypatch):
    import re

    from kit import score_parsing

    rows = LEGACY + "\n"  # RETURNN's usual rows: the regex fast path takes them
    fast = score_parsing.parse_returnn_lr_file(rows.strip())
    monkeypatch.setattr(score_parsing, "_FAST_ROW", re.compile(r"(?!)"))
    general = score_parsing.parse_returnn_lr_file(rows.strip())
    assert repr(fast) == repr(general)  # repr: nan == nan
    assert fast["epochs"][1]["meta"] == {"effective_learning_rate": 0.001}
