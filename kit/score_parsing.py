"""Reading score files without trusting them: kit's JSON and RETURNN's learning-rate file.

RETURNN's file is Python literal syntax (``{1: EpochData(learningRate=.., error={..}), ...}``).
It is read by a small tokenizer and recursive-descent parser of exactly that language —
literals, ``nan``/``inf``, and ``EpochData(...)`` as a row — never evaluated, in linear time
and a few times the file's size in memory (``ast.parse`` of a 16 MB file took 26 s and 2.2 GB).

Whatever the file holds, the result is a checked state dict or a
:class:`~kit.errors.ScoreFileError` naming the file and what is wrong (with a line number where
one helps): never a raw ``RecursionError``, ``UnicodeDecodeError``, ``OverflowError`` ...
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NoReturn

from kit.errors import ScoreFileError

FORMAT = "kit-scores"
VERSION = 1
META_PREFIX = ":meta:"  # RETURNN stores meta inside the error dict with this prefix
MAX_DEPTH = 100

_WS = r"[\x20\t\f\r\n]"  # Python's whitespace between tokens (not \v, nor Unicode spaces: RETURNN's eval refuses them)
_TOKEN = re.compile(
    r"""(?:[\x20\t\f\r\n]|\#[^\n]*)*(?:
      (?P<num>(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][-+]?\d+)?[jJ]?)
    | (?P<str>[rRbBuU]?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))
    | (?P<name>[A-Za-z_]\w*)
    | (?P<punct>[{}\[\](),:=+-])
    | (?P<end>\Z)
    )""",
    re.VERBOSE | re.ASCII,  # ASCII: \d and \w as Python's tokenizer reads numbers and names
)
# RETURNN's usual row, read by one regex match (the general parser takes any other shape)
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan)"
_ENTRY = rf"{_WS}*'[^'\\\n]*'{_WS}*:{_WS}*{_NUM}{_WS}*"
_FAST_ROW = re.compile(rf"(\d+){_WS}*:{_WS}*EpochData\({_WS}*learningRate{_WS}*={_WS}*({_NUM}){_WS}*,{_WS}*"
                       rf"error{_WS}*={_WS}*\{{((?:{_ENTRY},)*(?:{_ENTRY})?){_WS}*\}}{_WS}*,?{_WS}*\)", re.ASCII)
_FAST_ENTRY = re.compile(rf"{_WS}*'([^'\\\n]*)'{_WS}*:{_WS}*({_NUM})", re.ASCII)
_NAMES: dict[str, Any] = {"nan": math.nan, "inf": math.inf, "NaN": math.nan, "Infinity": math.inf,
                          "None": None, "True": True, "False": False}


def parse_score_text(text: str, path: str) -> dict[str, Any]:
    """A checked ScoreTable state dict from a score file's text (kit JSON or RETURNN's format)."""
    head = re.match(r"\s*(\{\s*\"|\S|$)", text[:4096])  # no copy of a large text: only its head is looked at
    if head is None or not head[1]:
        return {"epochs": {}, "error_keys": []}
    if head[1].startswith("{") and head[1].endswith('"'):
        return checked_state(_parse_json(text, path), path, in_place=True)
    return checked_state(parse_returnn_lr_file(text, path), path, in_place=True)


def _parse_json(text: str, path: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except RecursionError:
        raise ScoreFileError(f"score file '{path}': nested too deeply to be a score table") from None
    except json.JSONDecodeError as e:
        raise ScoreFileError(f"score file '{path}': invalid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
    except ValueError as e:  # e.g. an int of more than 4300 digits
        raise ScoreFileError(f"score file '{path}': {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ScoreFileError(f'score file \'{path}\': JSON but not a kit score table (no "format": "{FORMAT}")')
    if unknown := sorted(set(data) - {"format", "version", "error_keys", "epochs"}, key=str):
        raise ScoreFileError(f"score file '{path}': unknown entries {_show(unknown)} (a damaged file, or one "
                             "written by a newer kit)")
    version = data.get("version", VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ScoreFileError(f"score file '{path}': version is {version!r}, expected an int")
    if version > VERSION:
        raise ScoreFileError(f"score file '{path}': version {version} is newer than this kit ({VERSION})")
    return data


def parse_returnn_lr_file(text: str, path: str = "<text>") -> dict[str, Any]:
    """Parse RETURNN's learning-rate file into a ScoreTable state dict, without evaluating it.

    Accepts ``{epoch: EpochData(learningRate=.., error={..}), ...}`` with ``nan``/``inf``;
    ``:meta:`` entries of ``error`` become meta; an old-format float error becomes
    ``old_format_score``. Anything else (calls, attributes, imports) is refused.
    """
    if (nul := text.find("\0")) >= 0:  # Python (RETURNN's reader) refuses them too
        raise ScoreFileError(f"score file '{path}', line {text.count(chr(10), 0, nul) + 1}: a NUL byte "
                             "(the file is damaged)")
    return _Parser(text, path).file()


class _Parser:
    """Recursive descent over RETURNN's learning-rate file; nesting is bounded by :data:`MAX_DEPTH`."""

    def __init__(self, text: str, path: str):
        self.text, self.path, self.pos = text, path, 0
        self.kind, self.value, self.start = "", "", 0
        self.names: dict[str, str] = {}
        self.advance()

    # ---- tokens ---------------------------------------------------------------------------

    def advance(self) -> None:
        m = _TOKEN.match(self.text, self.pos)
        if m is None:
            self.start = self.pos + len(self.text[self.pos:]) - len(self.text[self.pos:].lstrip())
            self.fail(f"unexpected character {self.text[self.start:self.start + 1]!r}")
        self.kind = m.lastgroup or "end"
        self.value, self.start, self.pos = m.group(self.kind), m.start(self.kind), m.end()

    def fail(self, what: str) -> NoReturn:
        line = self.text.count("\n", 0, self.start) + 1
        raise ScoreFileError(f"score file '{self.path}', line {line}: {what}")

    def refuse(self, what: str) -> NoReturn:
        snippet = self.text[self.start:self.start + 60].split("\n")[0]
        self.fail(f"refused {snippet!r}: {what} (the file is parsed, never evaluated)")

    def expect(self, punct: str) -> None:
        if self.kind != "punct" or self.value != punct:
            self.fail(f"expected {punct!r}, got {self.value or 'the end of the file'!r}")
        self.advance()

    def at(self, punct: str) -> bool:
        return self.kind == "punct" and self.value == punct

    # ---- the file -------------------------------------------------------------------------

    def file(self) -> dict[str, Any]:
        if not self.at("{"):
            if self.kind == "end":
                self.fail("empty")
            self.refuse("expected a dict epoch -> EpochData(...) (neither kit JSON nor a RETURNN learning-rate file)")
        self.advance()
        epochs: dict[int, Any] = {}
        while not self.at("}"):
            if self.kind == "num" and (m := _FAST_ROW.match(self.text, self.start)) is not None:
                epochs[int(m[1])] = self.fast_row(m)
                if not self.at("}"):
                    self.expect(",")
                continue
            epoch = self.literal(1)
            if isinstance(epoch, bool) or not isinstance(epoch, int):
                self.fail(f"epoch keys must be ints, got {epoch!r}")
            self.expect(":")
            epochs[epoch] = self.epoch_data()
            if not self.at("}"):
                self.expect(",")
        self.advance()
        if self.kind != "end":
            self.refuse("text after the closing brace")
        return {"epochs": epochs, "error_keys": []}

    def fast_row(self, m: re.Match[str]) -> dict[str, Any]:
        """The row of a regex match of RETURNN's usual row shape (same result as the general parser)."""
        kwargs = {"learningRate": _number(m[2], self),
                  "error": {self.name(key): _number(value, self) for key, value in _FAST_ENTRY.findall(m[3])}}
        self.pos = m.end()
        self.advance()
        return _row_from_epoch_data(kwargs, self)

    def name(self, key: str) -> str:
        """One string object per distinct score name (60k rows share a handful of names)."""
        return self.names.setdefault(key, key)

    def epoch_data(self) -> dict[str, Any]:
        if not (self.kind == "name" and self.value == "EpochData"):
            self.refuse("only EpochData(...) entries are allowed")
        self.advance()
        self.expect("(")
        kwargs: dict[str, Any] = {}
        while not self.at(")"):
            if self.kind != "name":
                self.fail("EpochData takes keyword arguments only")
            name = self.value
            self.advance()
            self.expect("=")
            kwargs[name] = self.literal(2)
            if not self.at(")"):
                self.expect(",")
        self.advance()
        return _row_from_epoch_data(kwargs, self)

    # ---- literals -------------------------------------------------------------------------

    def literal(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            self.fail(f"nested deeper than {MAX_DEPTH} levels")
        kind, value = self.kind, self.value
        if kind == "num":
            self.advance()
            return _number(value, self)
        if kind == "str":
            self.advance()
            return _string(value, self)
        if kind == "name":
            if value not in _NAMES:
                self.refuse("only literals are allowed")
            self.advance()
            return _NAMES[value]
        if kind == "punct" and value in "+-":
            self.advance()
            operand = self.literal(depth + 1)
            if isinstance(operand, bool) or not isinstance(operand, (int, float)):
                self.fail(f"unary {value} of {operand!r}")
            return -operand if value == "-" else operand
        if kind == "punct" and value in "{[(":
            return self.container(value, depth)
        self.fail(f"expected a value, got {value or 'the end of the file'!r}")

    def container(self, opening: str, depth: int) -> Any:
        closing = {"{": "}", "[": "]", "(": ")"}[opening]
        self.advance()
        items: list[Any] = []
        keys: list[Any] = []
        commas = 0
        while not self.at(closing):
            if opening == "{":
                key = self.literal(depth + 1)
                if isinstance(key, (dict, list)):
                    self.fail(f"a dict key cannot be a {type(key).__name__}")
                keys.append(key)
                self.expect(":")
            items.append(self.literal(depth + 1))
            if not self.at(closing):
                self.expect(",")
                commas += 1
        self.advance()
        if opening == "{":
            return dict(zip(keys, items))
        if opening == "[":
            return items
        return items[0] if len(items) == 1 and not commas else tuple(items)


def _number(text: str, parser: _Parser) -> Any:
    if len(text) > 4000:  # int() refuses more than 4300 digits; float() would make it inf
        parser.fail(f"number {text[:20]}... of {len(text)} characters not readable")
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        parser.fail(f"not a number: {text[:40]!r}")


def _string(text: str, parser: _Parser) -> Any:
    if text[0] in "bB":
        parser.fail("byte strings are not score keys")
    body = text.lstrip("rRuU")
    raw = body[1:-1]
    if "\\" not in raw:
        return raw
    import ast

    return ast.literal_eval(text)  # one short string token: safe and bounded


def _row_from_epoch_data(kwargs: dict[str, Any], parser: _Parser) -> dict[str, Any]:
    lr = kwargs.pop("learningRate", kwargs.pop("learning_rate", None))
    error = kwargs.pop("error", None)
    meta = kwargs.pop("meta", None) or {}
    if not isinstance(meta, dict):
        parser.fail(f"EpochData meta must be a dict, got {meta!r}")
    if kwargs:
        parser.fail(f"unexpected EpochData arguments {sorted(kwargs)}")
    if isinstance(error, (int, float)) and not isinstance(error, bool):
        error = {"old_format_score": error}
    if error is not None and not isinstance(error, dict):
        parser.fail(f"EpochData error must be a dict, got {error!r}")
    scores = {}
    for k, v in (error or {}).items():
        if isinstance(k, str) and k.startswith(META_PREFIX):
            meta[k[len(META_PREFIX):]] = v
        else:
            scores[k] = v
    return {"learning_rate": lr, "scores": scores, "meta": dict(meta)}


# ---- the shape of a state dict ----------------------------------------------------------------


def checked_state(state: Any, path: str, *, in_place: bool = False) -> dict[str, Any]:
    """``state`` with every row checked and converted (floats, int epochs); ScoreFileError naming what is wrong.

    ``in_place``: rows are converted inside ``state`` (a freshly parsed file: no second copy in memory).
    """
    if not isinstance(state, Mapping):
        raise ScoreFileError(f"score file '{path}': a {type(state).__name__}, expected a table")
    epochs = state.get("epochs", {})
    if not isinstance(epochs, Mapping):
        raise ScoreFileError(f"score file '{path}': 'epochs' is a {type(epochs).__name__}, expected epoch -> row")
    rows = {}
    for key, row in epochs.items():
        epoch = _epoch_key(key, path)
        rows[epoch] = _checked_row(row, f"score file '{path}': epoch {epoch}", in_place)
    error_keys = state.get("error_keys", [])
    if not isinstance(error_keys, (list, tuple, set)) or not all(isinstance(k, str) for k in error_keys):
        raise ScoreFileError(f"score file '{path}': 'error_keys' is {_show(error_keys)}, expected a list of names")
    return {**state, "epochs": rows, "error_keys": list(error_keys)}


def _epoch_key(key: Any, path: str) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isdigit() and len(key) < 20:
        return int(key)
    raise ScoreFileError(f"score file '{path}': epoch {_show(key)} is not an epoch number")


def _checked_row(row: Any, where: str, in_place: bool = False) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise ScoreFileError(f"{where}: the row is a {type(row).__name__}, expected "
                             '{"learning_rate": .., "scores": {..}, "meta": {..}}')
    if unknown := sorted(set(row) - {"learning_rate", "scores", "meta"}, key=str):
        raise ScoreFileError(f"{where}: unknown row entries {_show(unknown)}, expected learning_rate, scores, meta")
    lr = row.get("learning_rate")
    scores, meta = row.get("scores", {}), row.get("meta", {})
    if not isinstance(scores, Mapping):
        raise ScoreFileError(f"{where}: scores is a {type(scores).__name__}, expected name -> number")
    if not isinstance(meta, Mapping):
        raise ScoreFileError(f"{where}: meta is a {type(meta).__name__}, expected name -> value")
    lr = None if lr is None else _float(lr, f"{where}: the learning rate")
    if lr is not None and not (math.isfinite(lr) and lr >= 0):
        raise ScoreFileError(f"{where}: the learning rate is {lr!r}; a learning rate is a finite number >= 0 "
                             "(as config key 'learning_rate'); fix or remove that row")
    if in_place and isinstance(row, dict) and isinstance(scores, dict) and isinstance(meta, dict) \
            and all(isinstance(k, str) for k in scores):
        for k, v in scores.items():
            scores[k] = _float(v, f"{where}: score {k!r}")
        row.update(learning_rate=lr, scores=scores, meta=meta)
        return row
    return {"learning_rate": lr, "scores": {str(k): _float(v, f"{where}: score {k!r}") for k, v in scores.items()},
            "meta": dict(meta)}


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScoreFileError(f"{what} is {_show(value)}, expected a number")
    try:
        return float(value)
    except OverflowError:
        raise ScoreFileError(f"{what} is an integer of {len(str(value))} digits, too large for a float") from None


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else f"a {len(str(value))}-digit int"
    return text if len(text) <= 60 else text[:57] + "..."
