"""Fuzzing score files (kit's JSON) and RETURNN learning-rate files: a ScoreFileError naming the file, or
exactly the table the mutated text says (checked against Python's own json / ast parsers), never anything else."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from fuzzlib import MUTATIONS, canonical, mutate, outcome
from hypothesis import given, settings
from hypothesis import strategies as st

from kit.score_parsing import checked_state
from kit.scores import ScoreTable

CASES = 300

LR_FILE = b"""{
1: EpochData(learningRate=0.01, error={
'dev_loss_ce': 0.69,
'train_loss_ce': 0.7,
':meta:global_train_step': 0,
':meta:distributed': None,
}),
2: EpochData(learningRate=0.005, error={
'dev_loss_ce': 0.65,
'dev_loss_fer': 0.25,
'train_loss_ce': nan,
':meta:global_train_step': 6,
}),
3: EpochData(learningRate=1e-3, error={}),
}
"""


def _kit_json() -> bytes:
    table = ScoreTable()
    for epoch in (1, 2, 3):
        table.set_learning_rate(epoch, 0.01 / epoch)
        table.set_scores(epoch, {"train_loss_ce": 1.0 / epoch, "dev_loss_ce": 1.1 / epoch, "dev_loss_fer": 0.3},
                         errors=["dev_loss_fer"])
        table.set_meta(epoch, global_train_step=10 * epoch, device="cpu")
    return table.to_json().encode()


KIT_JSON = _kit_json()

_NAMES: dict[str, Any] = {"nan": math.nan, "inf": math.inf, "NaN": math.nan, "Infinity": math.inf,
                          "None": None, "True": True, "False": False}


def _literal(node: ast.AST) -> Any:
    """Python's reading of one literal of RETURNN's file (EpochData(...) as a row), evaluating nothing."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("sign of a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "EpochData" and not node.args:
        kwargs = {k.arg: _literal(k.value) for k in node.keywords}
        if None in kwargs or len(kwargs) != len(node.keywords):
            raise ValueError("bad EpochData arguments")
        return _row(kwargs)
    raise ValueError(f"not a literal: {type(node).__name__}")


def _row(kwargs: dict) -> dict:
    lr = kwargs.pop("learningRate", kwargs.pop("learning_rate", None))
    error, meta = kwargs.pop("error", None), kwargs.pop("meta", None) or {}
    if kwargs or not isinstance(meta, dict):
        raise ValueError("unexpected EpochData arguments")
    if isinstance(error, (int, float)) and not isinstance(error, bool):
        error = {"old_format_score": error}
    if error is not None and not isinstance(error, dict):
        raise ValueError("error is not a dict")
    scores = {}
    for k, v in (error or {}).items():
        if isinstance(k, str) and k.startswith(":meta:"):
            meta[k[6:]] = v
        else:
            scores[k] = v
    return {"learning_rate": lr, "scores": scores, "meta": meta}


def reference(data: bytes) -> dict:
    """What the bytes say, read by Python's parsers, then kit's shape rules (raises if they say nothing valid)."""
    text = data.decode("utf-8")
    if not text.strip():
        return {"epochs": {}, "error_keys": []}
    if text.lstrip().startswith('{"') or text.lstrip().startswith("{\n \""):
        state = json.loads(text)
        if not isinstance(state, dict) or state.get("format") != "kit-scores":
            raise ValueError("not a kit table")
        version = state.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version > 1:
            raise ValueError("bad version")
    else:
        epochs = _literal(ast.parse(text, mode="eval").body)
        if not isinstance(epochs, dict) or not all(isinstance(r, dict) and "scores" in r for r in epochs.values()):
            raise ValueError("not a table of EpochData rows")
        state = {"epochs": epochs, "error_keys": []}
    checked = checked_state(state, "<reference>")
    return {"epochs": checked["epochs"], "error_keys": sorted(checked["error_keys"])}


def _check(tmp_path, original: bytes, mutations: list) -> None:
    path = tmp_path / "scores"
    data = mutate(original, mutations)
    path.write_bytes(data)
    kind, value = outcome(lambda: ScoreTable.load(path), path)
    if kind == "error":
        return
    got = value.state_dict()
    got = {"epochs": got["epochs"], "error_keys": sorted(got["error_keys"])}
    if canonical(got) == canonical(reference(original)):
        return  # what was written (a mutation of whitespace or a lenient spot in the syntax)
    try:
        expected = reference(data)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError, OverflowError, KeyError) as e:
        raise AssertionError(f"kit accepted a file Python's parsers reject ({type(e).__name__}: {e}): {data!r}") from e
    assert canonical(got) == canonical(expected), f"kit read other data than the file holds: {data!r}"


@settings(max_examples=CASES)
@given(mutations=MUTATIONS)
def test_fuzz_returnn_learning_rate_file(tmp_path, mutations):
    _check(tmp_path, LR_FILE, mutations)


@settings(max_examples=CASES)
@given(mutations=MUTATIONS)
def test_fuzz_kit_score_file(tmp_path, mutations):
    _check(tmp_path, KIT_JSON, mutations)


@settings(max_examples=CASES // 3)
@given(lr=st.one_of(st.floats(), st.integers(-(2**70), 2**70), st.text(max_size=5)),
       epoch=st.one_of(st.integers(-5, 2**70), st.text(max_size=4)))
def test_fuzz_learning_rate_values(tmp_path, lr, epoch):
    """Wrong types, huge and negative numbers in the places a learning-rate file has numbers."""
    data = LR_FILE.replace(b"3: EpochData(learningRate=1e-3", f"{epoch!r}: EpochData(learningRate={lr!r}".encode())
    _check(tmp_path, data, [])


def test_the_unmutated_files_read_back_exactly(tmp_path):  # the negative control of the property
    for original in (LR_FILE, KIT_JSON):
        (tmp_path / "s").write_bytes(original)
        state = ScoreTable.load(tmp_path / "s").state_dict()
        assert canonical({"epochs": state["epochs"], "error_keys": sorted(state["error_keys"])}) == \
            canonical(reference(original))
