"""The files of a run under attack or misuse: malformed manifests, foreign temp files, a second run
on the same prefix, cleanup during an epoch, permissions, an unwritable ``model`` path."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers.faults import fail_writes_after
from helpers.models import TinyModel, tiny_config

import kit
import kit.checkpoints as ck
from kit.checkpoints.lock import PrefixLockedError
from kit.engine.engine import Engine
from kit.fileio import TEMP_MARK


def save(prefix, epoch: int, **kw):
    return ck.save(str(prefix), epoch=epoch, model_state=TinyModel().state_dict(), train_state={"progress": {}},
                   global_train_step=epoch * 10, **kw)


# ---- 1: any malformed manifest is an incomplete checkpoint -------------------------------------------


def _edit(key_path, value):
    def edit(m):
        *parents, last = key_path
        for k in parents:
            m = m[k]
        m[last] = value
    return edit


def _rewrite(edit):
    def damage(path):
        m = json.loads(Path(path).read_text())
        edit(m)
        Path(path).write_text(json.dumps(m))
    return damage


def _replace_text(text):
    return lambda path: Path(path).write_bytes(text if isinstance(text, bytes) else text.encode())


def _fifo(path):
    os.unlink(path)
    os.mkfifo(path)


def _folder(path):
    os.unlink(path)
    os.mkdir(path)


MANIFEST_DAMAGE = {
    "flipped key size->shze": lambda p: _replace_text(Path(p).read_text().replace('"size"', '"shze"', 1))(p),
    "size a string": _rewrite(_edit(["files", "model", "size"], "123")),
    "size negative": _rewrite(_edit(["files", "model", "size"], -1)),
    "model entry a list": _rewrite(_edit(["files", "model"], [1, 2])),
    "files a string": _rewrite(_edit(["files"], "x")),
    "sha256 not hex": _rewrite(_edit(["files", "model", "sha256"], 5)),
    "global_train_step 1e999": lambda p: _replace_text(
        Path(p).read_text().replace('"global_train_step": 20', '"global_train_step": 1e999'))(p),
    "epoch a float": _rewrite(_edit(["epoch"], 2.0)),
    "kind unknown": _rewrite(_edit(["kind"], "weird")),
    "100k nested [": _replace_text("[" * 100_000),
    "JSON list": _replace_text("[1, 2]"),
    "non-UTF-8 byte": lambda p: _replace_text(Path(p).read_bytes().replace(b'"kind"', b'"k\xffnd"'))(p),
    "empty": _replace_text(""),
    "2 MB of junk": _replace_text(b" " * (2 << 20)),
    "FIFO": _fifo,
    "folder": _folder,
}
_MANIFEST_TALLY = {"tried": 0, "fell back": 0}


def _in_thread(fn, timeout=20.0):
    """fn() in a thread: a read that blocks (e.g. on a FIFO) fails the test instead of hanging it."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "blocked"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("case", list(MANIFEST_DAMAGE))
def test_a_malformed_manifest_means_an_incomplete_checkpoint(tmp_model_prefix, case, caplog):
    save(tmp_model_prefix, 1)
    e2 = save(tmp_model_prefix, 2)
    MANIFEST_DAMAGE[case](e2.manifest_path)
    _MANIFEST_TALLY["tried"] += 1
    listed = _in_thread(lambda: ck.list_checkpoints(str(tmp_model_prefix)))
    assert [c.epoch for c in listed] == [1, 2]
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert _in_thread(lambda: ck.latest(str(tmp_model_prefix))).epoch == 1
        ckpt, model_file, _ = _in_thread(lambda: ck.load_latest(str(tmp_model_prefix)))
    assert ckpt.epoch == model_file["epoch"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("model.002.manifest.json" in w for w in warnings), warnings
    with pytest.raises(kit.CorruptCheckpointError, match="model.002.manifest.json"):
        _in_thread(lambda: ck.verify(next(c for c in listed if c.epoch == 2)))
    _MANIFEST_TALLY["fell back"] += 1
    print(f"\nmalformed manifests: {_MANIFEST_TALLY['fell back']} fell back with a named warning "
          f"/ {_MANIFEST_TALLY['tried']} tried")


def test_the_engine_resumes_from_the_previous_checkpoint_past_a_malformed_manifest(tmp_path):
    prefix = str(tmp_path / "model")
    Engine(kit.Config(tiny_config(prefix, num_epochs=2))).train()
    MANIFEST_DAMAGE["global_train_step 1e999"](prefix + ".002.manifest.json")
    Path(prefix + ".002.manifest.json").write_text(
        Path(prefix + ".002.manifest.json").read_text().replace('"size"', '"shze"'))
    engine = Engine(kit.Config(tiny_config(prefix, num_epochs=2)))
    engine.setup()
    assert engine.progress.epoch == 2


# ---- 4: a save removes only its own prefix's temp files of dead writers ---------------------------------


def test_a_save_removes_only_its_own_prefix_temp_files(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    live = tmp_path / f"exp2.001.pt{TEMP_MARK}{os.getpid()}-abcd1234"  # exp2's write in progress
    foreign_dead = tmp_path / f"exp2.001.pt{TEMP_MARK}{dead_pid}-abcd1234"  # exp2's to clean, not exp's
    own_dead = tmp_path / f"exp.001.pt{TEMP_MARK}{dead_pid}-abcd1234"
    own_live = tmp_path / f"exp.002.opt.pt{TEMP_MARK}{os.getpid()}-abcd1234"
    other = tmp_path / f"notes.txt{TEMP_MARK}{dead_pid}-abcd1234"
    for p in (live, foreign_dead, own_dead, own_live, other):
        p.write_bytes(b"partial")
    save(tmp_path / "exp", 1)
    assert live.exists() and foreign_dead.exists() and other.exists() and own_live.exists()
    assert not own_dead.exists()


# ---- 5: one run per prefix; a changed config is named --------------------------------------------------


_HOLD = textwrap.dedent("""
    import sys, time
    from kit.checkpoints.lock import PrefixLock
    lock = PrefixLock.acquire(sys.argv[1])
    print("locked", flush=True)
    time.sleep(60)
""")


def test_a_second_run_on_the_same_prefix_fails_at_start_naming_the_holder(tmp_path):
    prefix = str(tmp_path / "run" / "model")
    env = dict(os.environ, PYTHONPATH=str(Path(kit.__file__).resolve().parents[1]))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, prefix], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        engine = Engine(kit.Config(tiny_config(prefix, num_epochs=1)))
        with pytest.raises(PrefixLockedError, match=rf"{prefix}.*pid {holder.pid}") as info:
            engine.setup()
        assert isinstance(info.value, kit.KitError)
        assert not engine.is_set_up and not ck.list_checkpoints(prefix)
    finally:
        holder.kill()
        holder.wait()
    # the holder is dead (killed): its lock is taken over, no cleanup needed
    engine = Engine(kit.Config(tiny_config(prefix, num_epochs=1)))
    engine.train()
    engine.close()
    assert not os.path.exists(prefix + ".lock")  # removed at the clean exit


def test_in_one_process_the_newest_engine_takes_the_prefix_over(tmp_path, caplog):
    prefix = str(tmp_path / "model")
    first = Engine(kit.Config(tiny_config(prefix, num_epochs=1)))
    first.setup()
    with caplog.at_level(logging.WARNING, logger="kit"):
        second = Engine(kit.Config(tiny_config(prefix, num_epochs=1)))
        second.setup()
    assert "takes it over" in caplog.text
    first.train_step()
    with pytest.raises(PrefixLockedError, match="no longer holds the lock"):
        first.save_checkpoint()
    second.train_step()
    second.save_checkpoint()
    first.close()  # releasing an old holder does not release the new one's lock
    assert second.prefix_lock.held
    second.close()
    assert second.prefix_lock is None


def test_a_resume_with_a_changed_config_names_the_changed_keys(tmp_path, caplog):
    prefix = str(tmp_path / "model")
    Engine(kit.Config(tiny_config(prefix, num_epochs=1))).train()
    with caplog.at_level(logging.WARNING, logger="kit"):
        Engine(kit.Config(tiny_config(prefix, num_epochs=2))).setup()  # a longer run: no warning
    assert "config changed" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="kit"):
        Engine(kit.Config(tiny_config(prefix, num_epochs=2, learning_rate=0.02, max_seqs=5))).setup()
    lines = [r.getMessage() for r in caplog.records if "config changed" in r.getMessage()]
    assert len(lines) == 1 and "learning_rate, max_seqs" in lines[0] and "num_epochs" not in lines[0]


# ---- 6: cleanup after every save ---------------------------------------------------------------------


def test_step_checkpoints_do_not_pile_up_during_an_epoch(tmp_path):
    prefix = str(tmp_path / "model")
    engine = Engine(kit.Config(tiny_config(prefix, num_epochs=1, save_every_n_steps=1,
                                           cleanup_old_models={"keep_last_n": 1, "keep_best_n": 0})))
    most = 0
    while engine.train_step() is not None:
        most = max(most, sum(c.complete for c in ck.list_checkpoints(prefix)))
    assert engine.progress.step_in_epoch > 5 and most == 1
    engine.finish_epoch()
    assert [c.name for c in ck.list_checkpoints(prefix)] == ["model.001"]


# ---- 7: permissions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        c = save(tmp_path / "model", 1)
        table = kit.ScoreTable(tmp_path / "scores.json")
        table.set_learning_rate(1, 0.1)
        table.save()
    finally:
        os.umask(old)
    for path in (c.path, c.opt_path, c.manifest_path, str(tmp_path / "scores.json")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask, path


# ---- 8: an unwritable model path fails before the first step; a full disk names the file -------------


@pytest.mark.parametrize("where", ["proc", "under a file", "a folder"])
def test_an_impossible_model_path_is_one_config_error_before_the_first_step(tmp_path, where):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "afolder").mkdir()
    model = {"proc": "/proc/kit-no-such/model", "under a file": str(tmp_path / "afile" / "model"),
             "a folder": str(tmp_path / "afolder")}[where]
    engine = Engine(kit.Config(tiny_config(model, num_epochs=1)))
    steps = []
    engine.events.on("step_begin", lambda **kw: steps.append(kw))
    with pytest.raises(kit.ConfigError, match=r"config key 'model'") as info:
        engine.train()
    assert model in str(info.value) and not steps
    assert len(info.value.problems) == 1


def test_a_read_only_model_folder_is_a_config_error(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:  # root writes into a 0o500 folder: refuse creating files there, as the kernel would
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and os.path.dirname(os.path.abspath(path)) == str(folder):
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    try:
        with pytest.raises(kit.ConfigError, match="config key 'model'.*ro.*Permission denied"):
            Engine(kit.Config(tiny_config(str(folder / "model"), num_epochs=1))).setup()
    finally:
        folder.chmod(0o700)


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    fail_writes_after(monkeypatch, 500, match=lambda p: p.endswith(".opt.pt"))
    with pytest.raises(OSError, match=r"No space left.*model\.001\.opt\.pt"):
        save(tmp_path / "model", 1)
    assert not [n for n in os.listdir(tmp_path) if TEMP_MARK in n]


# ---- 14, 16: checked when the config is read -----------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ({"keep_best_n_keys": ["dev_loss_ce"]}, "unknown option 'keep_best_n_keys'"),
    ({"keep_last_n": -1}, "keep_last_n must be an int >= 0"),
    ({"keep_best_n": {"dev_loss_ce": "2"}}, "keep_best_n\\['dev_loss_ce'\\] must be an int >= 0"),
    ({"keep": "1,2"}, "keep must be a list of epochs"),
    ({"dry_run": "yes"}, "dry_run must be True or False"),
    ("all", "True, False or a dict"),
])
def test_cleanup_old_models_is_checked_when_the_config_is_read(value, expected):
    with pytest.raises(kit.ConfigError, match=r"cleanup_old_models.*" + expected):
        kit.Config(tiny_config(cleanup_old_models=value))


def test_cleanup_and_the_config_check_agree():
    good = {"keep_last_n": 1, "keep_best_n": {"dev_loss_ce": 2}, "keep": [3], "dry_run": True}
    kit.Config(tiny_config(cleanup_old_models=good))  # negative control: a good spec passes
    from kit.checkpoints.cleanup import cleanup

    with pytest.raises(kit.ConfigError, match="keep_best_n_keys"):
        cleanup("/nonexistent/model", {"keep_best_n_keys": 1})


@pytest.mark.parametrize("key, value, expected", [
    ("eval_datasets", "dev", "a dict name -> dataset"),
    ("eval_datasets", ["dev", "test"], "a dict name -> dataset"),
    ("preload_from_files", {"base": "base.pt"}, "entry 'base' is not a dict with a 'filename'"),
    ("preload_from_files", ["base.pt"], "a dict name -> \\{'filename'"),
])
def test_dataset_and_preload_shapes_are_checked_when_the_config_is_read(key, value, expected):
    with pytest.raises(kit.ConfigError, match=rf"config key '{key}'.*{expected}"):
        kit.Config(tiny_config(**{key: value}))


def test_a_good_preload_entry_passes():
    kit.Config(tiny_config(preload_from_files={"base": {"filename": "base.pt", "init_for_train": True}}))
