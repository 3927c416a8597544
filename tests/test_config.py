"""``kit.Config``: construction from kwargs / dict / file, validation, typed getters."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import kit
from kit.config.keys import KEYS


def write_config(tmp_path: Path, text: str, name: str = "config.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


# ---- construction ---------------------------------------------------------------------


def test_from_kwargs():
    config = kit.Config(batch_size=1000, max_seqs=8, learning_rate=0.01)
    assert config["batch_size"] == 1000
    assert config.int("max_seqs") == 8
    assert config.float("learning_rate") == 0.01
    assert set(config) == {"batch_size", "max_seqs", "learning_rate"}
    assert len(config) == 3


def test_from_dict_and_kwargs_together():
    config = kit.Config({"batch_size": 1000, "max_seqs": 8}, max_seqs=16)
    assert config.as_dict() == {"batch_size": 1000, "max_seqs": 16}


def test_from_config_object():
    config = kit.Config(kit.Config(batch_size=7))
    assert config.int("batch_size") == 7


def test_path_given_to_constructor_points_to_from_file(tmp_path):
    with pytest.raises(kit.ConfigError, match="from_file"):
        kit.Config(str(tmp_path / "config.py"))


def test_from_file_basic(tmp_path):
    path = write_config(
        tmp_path,
        """
        #!rnn.py
        batch_size = 2000
        max_seqs = 32
        learning_rate = 1e-3
        """,
    )
    config = kit.Config.from_file(path)
    assert config.int("batch_size") == 2000
    assert config.int("max_seqs") == 32
    assert config.float("learning_rate") == 1e-3
    assert config.source == os.path.abspath(path)


def test_from_file_accepts_pathlike_and_str(tmp_path):
    path = write_config(tmp_path, "num_epochs = 3\n")
    assert kit.Config.from_file(path).int("num_epochs") == 3
    assert kit.Config.from_file(str(path)).int("num_epochs") == 3


def test_from_file_keeps_user_globals(tmp_path):
    path = write_config(
        tmp_path,
        """
        #!rnn.py
        import math
        import os.path
        from collections import OrderedDict

        HIDDEN = 64
        _private = "not kept"

        class MyModel:
            def __init__(self, dim=HIDDEN):
                self.dim = dim

        def get_model(*, epoch, step, **_):
            return MyModel()

        def helper(x):
            return math.sqrt(x) + HIDDEN

        batch_size = HIDDEN * 10
        """,
    )
    config = kit.Config.from_file(path)
    user = config.user_globals
    assert user["HIDDEN"] == 64
    assert user["helper"](4) == 66.0
    assert user["MyModel"]().dim == 64
    assert user["OrderedDict"] is __import__("collections").OrderedDict
    # modules and private names are not kept; config keys are not user globals
    assert "math" not in user and "os" not in user
    assert "_private" not in user
    assert "batch_size" not in user and "get_model" not in user
    assert config.int("batch_size") == 640
    assert config["get_model"](epoch=1, step=0).dim == 64
    # user globals are reachable by name but are not config keys
    assert config["HIDDEN"] == 64
    assert config.typed_value("HIDDEN") == 64
    assert "HIDDEN" not in set(config)
    # the returned dict is a copy
    user["HIDDEN"] = 1
    assert config.user_globals["HIDDEN"] == 64


def test_from_file_functions_see_file_globals(tmp_path):
    path = write_config(
        tmp_path,
        """
        SCALE = 3
        def dynamic_learning_rate(*, learning_rate, **_):
            return learning_rate * SCALE
        """,
    )
    config = kit.Config.from_file(path)
    assert config["dynamic_learning_rate"](learning_rate=2.0) == 6.0


def test_from_file_overrides(tmp_path):
    path = write_config(tmp_path, "batch_size = 2000\nmax_seqs = 32\n")
    config = kit.Config.from_file(path, max_seqs=4, num_epochs=2)
    assert config.int("batch_size") == 2000
    assert config.int("max_seqs") == 4
    assert config.int("num_epochs") == 2


def test_from_file_bad_override_is_an_error(tmp_path):
    path = write_config(tmp_path, "batch_size = 2000\n")
    with pytest.raises(kit.ConfigError, match="did you mean 'max_seqs'"):
        kit.Config.from_file(path, max_seq=4)


def test_unreadable_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "config.py"
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(tmp_path)  # a directory
    assert str(tmp_path) in str(info.value)


def test_binary_file_names_the_path(tmp_path):
    path = tmp_path / "config.py"
    path.write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(path)
    assert str(path) in str(info.value)


def test_syntax_error_names_the_file(tmp_path):
    path = write_config(tmp_path, "batch_size = (\n")
    with pytest.raises(SyntaxError) as info:
        kit.Config.from_file(path)
    assert info.value.filename == str(path)


def test_exception_while_running_file_names_the_path(tmp_path):
    path = write_config(tmp_path, "batch_size = 1 // 0\n")
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(path)
    assert str(path) in str(info.value)
    assert "ZeroDivisionError" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


# ---- unknown and replaced keys --------------------------------------------------------


def test_unknown_kwarg_suggests_the_right_key():
    with pytest.raises(kit.ConfigError) as info:
        kit.Config(learnig_rate=0.1)
    assert str(info.value) == "unknown config key 'learnig_rate' — did you mean 'learning_rate'?"


def test_unknown_kwarg_without_close_match_points_to_docs():
    with pytest.raises(kit.ConfigError, match="unknown config key 'zzz_qqq'.*docs/config.md"):
        kit.Config(zzz_qqq=1)


def test_near_miss_global_in_file_is_an_error(tmp_path):
    path = write_config(tmp_path, "learnig_rate = 0.1\nHIDDEN = 3\n")
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(path)
    message = str(info.value)
    assert "'learnig_rate'" in message
    assert "did you mean 'learning_rate'" in message
    assert str(path) in message


def test_debug_shell_before_train_loop_points_to_debug_hook(tmp_path):
    with pytest.raises(kit.ConfigError) as info:
        kit.Config(debug_shell_before_train_loop=True)
    assert "debug_shell_before_train_loop" in str(info.value)
    assert "debug_hook" in str(info.value)

    path = write_config(tmp_path, "debug_shell_before_train_loop = True\n")
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(path)
    assert "debug_hook" in str(info.value)
    assert str(path) in str(info.value)


def test_debug_hook_is_accepted():
    def hook(ctx):
        return None

    assert kit.Config(debug_hook=hook)["debug_hook"] is hook


# ---- value checks ---------------------------------------------------------------------


def test_all_value_problems_in_one_error():
    bad = {"batch_size": 0, "learning_rate": -1, "max_seqs": "x", "chunking": "10:x", "torch_amp": "float8"}
    with pytest.raises(kit.ConfigError) as info:
        kit.Config(**bad)
    error = info.value
    assert len(error.problems) == len(bad)
    message = str(error)
    for name, value in bad.items():
        line = next(p for p in error.problems if f"'{name}'" in p)
        assert repr(value) in line, line
        assert "expected" in line, line
        assert name in message
    assert "positive int" in message  # batch_size, max_seqs
    assert ">= 0" in message  # learning_rate
    assert "size:step" in message  # chunking
    assert "'float16'" in message and "'bfloat16'" in message  # torch_amp


def test_unknown_and_bad_values_together_in_one_error():
    with pytest.raises(kit.ConfigError) as info:
        kit.Config(learnig_rate=0.1, batch_size=-5)
    assert len(info.value.problems) == 2


def test_value_problems_in_file_name_the_file(tmp_path):
    path = write_config(tmp_path, "batch_size = 0\nmax_seqs = 'x'\n")
    with pytest.raises(kit.ConfigError) as info:
        kit.Config.from_file(path)
    assert len(info.value.problems) == 2
    assert all(str(path) in p for p in info.value.problems)


@pytest.mark.parametrize(
    "key, value",
    [
        ("batch_size", 1),
        ("batch_size", {"data": 100, "classes": 50}),
        ("max_seqs", None),
        ("chunking", 100),
        ("chunking", "100:50"),
        ("chunking", (100, 50)),
        ("chunking", ({"data": 100}, {"data": 50})),
        ("torch_amp", "bfloat16"),
        ("torch_amp", {"dtype": "float16", "grad_scaler": {"init_scale": 2.0**10}}),
        ("learning_rate", 0),
        ("learning_rates", [0.1, 0.05]),
        ("learning_rates", {1: 0.1, 5: 0.01}),
        ("optimizer", {"class": "adamw", "weight_decay": 0.01}),
        ("seq_ordering", "laplace:.100"),
        ("cleanup_old_models", {"keep_last_n": 2}),
    ],
)
def test_good_values_are_accepted(key, value):
    assert kit.Config({key: value})[key] == value


@pytest.mark.parametrize(
    "key, value",
    [
        ("batch_size", True),
        ("batch_size", 1.5),
        ("num_epochs", 0),
        ("chunking", "0:5"),
        ("learning_rates", "[0.1, 0.2]"),  # strings are never evaluated
        ("learning_rate_control", "newbobb"),
        ("nonfinite_policy", "ignore"),
        ("optimizer", {"lr": 0.1}),
        ("cleanup_old_models", {"keep_last": 2}),
    ],
)
def test_bad_values_are_rejected(key, value):
    with pytest.raises(kit.ConfigError, match=f"'{key}'"):
        kit.Config({key: value})


def test_lr_inside_optimizer_points_to_learning_rate():
    with pytest.raises(kit.ConfigError) as info:
        kit.Config(optimizer={"class": "adamw", "lr": 1e-3})
    assert "'optimizer'" in str(info.value)
    assert "learning_rate" in str(info.value)


def test_failed_update_changes_nothing():
    config = kit.Config(batch_size=100)
    with pytest.raises(kit.ConfigError):
        config.update(batch_size=200, max_seqs=0)
    assert config.int("batch_size") == 100
    assert not config.has("max_seqs")


# ---- getters --------------------------------------------------------------------------


def test_registry_defaults():
    config = kit.Config()
    assert config.int("batch_size") == KEYS["batch_size"].default == 5000
    assert config.int("num_epochs") == 5  # RETURNN's default
    assert config.float("learning_rate") == 1.0
    assert config.bool("stop_on_nonfinite_train_score") is True
    assert config.typed_value("learning_rate_control") == "constant"
    assert config.value("max_seqs") is None
    assert config.int("max_seqs") is None
    assert not config.has("batch_size")
    assert "batch_size" not in config
    with pytest.raises(KeyError):
        config["batch_size"]  # the mapping holds only explicitly set keys


def test_explicit_default_wins_over_registry_default():
    config = kit.Config()
    assert config.int("max_seqs", 7) == 7
    assert config.float("learning_rate", 0.5) == 0.5
    assert config.typed_value("batch_size", None) is None
    assert kit.Config(max_seqs=3).int("max_seqs", 7) == 3


def test_unknown_key_in_getter_suggests():
    with pytest.raises(KeyError, match="did you mean 'max_seqs'"):
        kit.Config().typed_value("max_seq")
    assert kit.Config().typed_value("max_seq", 5) == 5


def test_get_follows_mapping_contract():
    config = kit.Config(max_seqs=3)
    assert config.get("max_seqs") == 3
    assert config.get("batch_size") == 5000  # registry default
    assert config.get("not_a_key") is None
    assert config.get("not_a_key", 1) == 1


def test_typed_getter_conversions():
    config = kit.Config(learning_rate=1, max_seqs=4)
    assert isinstance(config.float("learning_rate"), float)
    assert config.int("max_seqs") == 4
    assert kit.Config(chunking_in_eval=True).bool("chunking_in_eval") is True


def test_typed_getters_reject_wrong_types(tmp_path):
    path = write_config(tmp_path, "N = 'abc'\nFLAG = 'maybe'\nHALF = 2.5\nWHOLE = 3.0\nON = 'yes'\n")
    config = kit.Config.from_file(path)
    with pytest.raises(kit.ConfigError, match="'N'.*expected an int"):
        config.int("N")
    with pytest.raises(kit.ConfigError, match="'N'.*expected a float"):
        config.float("N")
    with pytest.raises(kit.ConfigError, match="'FLAG'.*True or False"):
        config.bool("FLAG")
    with pytest.raises(kit.ConfigError, match="'HALF'.*expected an int"):
        config.int("HALF")  # never truncated silently
    assert config.int("WHOLE") == 3
    assert config.bool("ON") is True


def test_update_and_copy():
    config = kit.Config(batch_size=100)
    assert config.update({"max_seqs": 2}, num_epochs=3) is config
    assert config.as_dict() == {"batch_size": 100, "max_seqs": 2, "num_epochs": 3}
    other = config.copy()
    other.update(batch_size=5)
    assert config.int("batch_size") == 100
    assert other.int("batch_size") == 5
    with pytest.raises(kit.ConfigError, match="did you mean 'num_epochs'"):
        config.update(num_epoch=4)


def test_digest_is_stable_and_changes_with_values():
    def get_model(**_):
        return None

    a = kit.Config(batch_size=100, get_model=get_model)
    b = kit.Config(get_model=get_model, batch_size=100)
    assert a.digest() == b.digest()
    assert a.digest() != kit.Config(batch_size=101, get_model=get_model).digest()
    assert "get_model" in repr(a) and " at 0x" not in repr(a)


def test_config_error_is_a_value_error():
    assert issubclass(kit.ConfigError, ValueError)
    assert issubclass(kit.ConfigError, kit.KitError)


def test_overrides_reach_the_config_files_own_globals_and_its_functions(tmp_path):
    """RETURNN's command line may override a config file's constants; its functions see the new value."""
    path = tmp_path / "cfg.py"
    path.write_text("hidden = 32\nnum_epochs = 2\n\ndef get_model(**kwargs):\n    return hidden\n")
    config = kit.Config.from_file(path, hidden=64, num_epochs=3)
    assert config["hidden"] == 64
    assert config.typed_value("get_model")() == 64
    assert config.int("num_epochs") == 3
    with pytest.raises(kit.ConfigError, match="did you mean 'hidden'"):
        kit.Config.from_file(path, hiden=64)


def test_getters_are_typed_optional_exactly_for_the_keys_without_a_default():
    """Config.int / Config.float read as ``X | None`` only for keys whose registry default is None."""
    import typing

    from kit.config.config import FloatKeyWithoutDefault, IntKeyWithoutDefault

    for literal, kind in ((IntKeyWithoutDefault, "int"), (FloatKeyWithoutDefault, "float")):
        without = {k.name for k in KEYS.values() if k.type == kind and k.default is None}
        assert set(typing.get_args(literal)) == without, f"update the {kind} list in kit/config/config.py"
    assert kit.Config().int("max_seqs") is None and kit.Config().int("batch_size") == 5000
