"""Every RETURNN key kit does not support says why, beside it in docs/returnn_keys.md (issue 28)."""

from __future__ import annotations

import pytest

from kit.compat import returnn_keys
from kit.compat.returnn_keys import RETURNN_KEYS, ReturnnKey, keys_without_reason


def test_every_key_kit_does_not_support_has_a_reason():
    assert keys_without_reason() == []
    for name, key in RETURNN_KEYS.items():
        if key.status in ("unsupported", "no effect", "replaced"):
            assert len(key.note.strip()) > 10, name


def test_a_key_without_a_reason_is_found_and_stops_the_doc(monkeypatch):
    table = {"fine": ReturnnKey("fine", "unsupported", "read only by returnn/tf/engine.py (TensorFlow backend)"),
             "some_key": ReturnnKey("some_key", "unsupported"), "other_key": ReturnnKey("other_key", "no effect", "  ")}
    assert keys_without_reason(table) == ["other_key", "some_key"]  # negative control: an empty note is caught
    monkeypatch.setattr(returnn_keys, "RETURNN_KEYS", table)
    with pytest.raises(ValueError, match="other_key, some_key"):
        returnn_keys.returnn_keys_markdown()


def test_kit_keys_need_no_reason():
    assert keys_without_reason({"x": ReturnnKey("x", "kit")}) == []
