"""Every RETURNN key kit does not support says why, beside it in docs/returnn_keys.md (issue 28)."""

from __future__ import annotations

import pytest

from kit.compat import returnn_keys
from kit.compat.returnn_keys import RETURNN_KEYS, ReturnnKey, keys_without_reason
from tests.returnn_compat.returnn_helpers import needs_returnn, run_python


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


@needs_returnn
def test_a_second_behavior_version_in_one_process_is_a_config_error():
    """RETURNN sets its behaviour version once per process; kit says so instead of running under the wrong one."""
    code = (
        "from kit.compat.global_config import set_behavior_version\n"
        "from kit.errors import ConfigError\n"
        "from returnn.util.basic import BehaviorVersion\n"
        "set_behavior_version(21); set_behavior_version(21)\n"  # the same again: fine
        "assert BehaviorVersion.get() == 21\n"
        "try:\n"
        "    set_behavior_version(22)\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    out = run_python(["-c", code]).stdout
    assert "refused: config key 'behavior_version': 22" in out and "already 21" in out
