"""The prefix lock means what it says, and a config error is raised before any work and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.models import tiny_config

import kit
from kit.checkpoints.lock import PrefixLock, PrefixLockedError
from kit.engine.engine import Engine
from kit.errors import ConfigError

_HOLD = textwrap.dedent("""
    import sys
    from kit.checkpoints.lock import PrefixLock
    lock = PrefixLock.acquire(sys.argv[1])
    print("locked", flush=True)
    sys.stdin.readline()
    lock.release()
    print("released", flush=True)
""")


def _holder(prefix: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(kit.__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.parametrize("tamper", ["deleted", "replaced", "none"])
def test_a_held_prefix_stays_held_whatever_happens_to_its_lock_file(tmp_path, tamper):
    prefix = str(tmp_path / "model")
    holder = _holder(prefix)
    try:
        lock_file = Path(prefix + ".lock")
        if tamper == "deleted":
            lock_file.unlink()
        elif tamper == "replaced":
            lock_file.unlink()
            lock_file.write_text("pid 1 on nowhere\n")
        with pytest.raises(PrefixLockedError, match="in use by another run"):
            PrefixLock.acquire(prefix)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
    finally:
        holder.kill()
        holder.wait()
    lock = PrefixLock.acquire(prefix)  # the holder is gone: the prefix is free again
    assert lock.held
    lock.release()
    assert not os.path.exists(prefix + ".lock")


def test_a_clean_exit_leaves_no_lock_file(tmp_path):
    prefix = str(tmp_path / "model")
    engine = Engine(kit.Config(tiny_config(prefix, num_epochs=1)))
    engine.train()
    engine.close()
    assert os.path.exists(prefix + ".001.pt") and not os.path.exists(prefix + ".lock")


@pytest.mark.parametrize("bad", [
    {"extern_data": {"data": {"shape": "abc"}}},
    {"torch_dataloader_opts": {"num_workers": "two"}},
    {"learning_rate_control": "newbob", "learning_rate_control_error_measure": "dve_loss_ce"},
    {"learning_rate_control": "newbob_multi_epoch", "learning_rate_control_error_measure": "dev_score"},
    {"get_model": None},
])
def test_a_config_error_writes_nothing(tmp_path, bad):
    run_dir = tmp_path / "run" / "deeper"
    with pytest.raises(kit.KitError) as info:
        Engine(kit.Config(tiny_config(str(run_dir / "model"), **bad))).train()
    assert list(bad)[-1] in str(info.value) or "get_model" in str(info.value)
    assert not (tmp_path / "run").exists(), sorted(p.name for p in tmp_path.rglob("*"))


def test_an_error_measure_naming_an_unknown_loss_loses_no_training(tmp_path):
    """The loss names are known only after a step: newbob's first look at the scores (after epoch 2) saves
    the epoch, then names the key; a rerun stops before its first step."""
    prefix = str(tmp_path / "model")
    cfg = tiny_config(prefix, num_epochs=3, learning_rate_control="newbob",
                      learning_rate_control_error_measure="dev_loss_xyz")
    engine = Engine(kit.Config(cfg))
    with pytest.raises(ConfigError, match="dev_loss_xyz.*dev_loss_ce"):
        engine.train()
    engine.close()
    assert os.path.exists(prefix + ".002.manifest.json")
    again = Engine(kit.Config(cfg))
    with pytest.raises(ConfigError, match="dev_loss_xyz"):
        again.train()
    assert again.progress.global_train_step == engine.progress.global_train_step
    again.close()
    assert not os.path.exists(prefix + ".lock")
