"""Checkpoints under faults: failed and killed writes, damaged files, malicious pickles."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import slow_writes
from helpers.faults import (
    CODE_CARRYING_KINDS,
    FailAfterNBytes,
    InjectedCrash,
    crash_writes_after,
    fail_writes_after,
    flip_byte,
    truncate_file,
    write_code_carrying_file,
    write_malicious_checkpoint,
)
from helpers.models import tiny_config

import kit
import kit.checkpoints as ck
from kit.engine.engine import Engine
from kit.fileio import TEMP_MARK


def make_state(seed: int, width: int = 64) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return model.state_dict(), {
        "optimizer": opt.state_dict(),
        "progress": {"epoch": seed, "data_pos": seed * 10},
    }


def save(prefix, epoch, **kw):
    model_state, train_state = make_state(epoch)
    return ck.save(
        str(prefix),
        epoch=epoch,
        model_state=model_state,
        train_state=train_state,
        global_train_step=epoch * 10,
        **kw,
    )


def digests(ckpt) -> dict:
    return {
        p: hashlib.sha256(open(p, "rb").read()).hexdigest()
        for p in (ckpt.path, ckpt.opt_path, ckpt.manifest_path)
    }


def temp_files(directory) -> list[str]:
    return [n for n in os.listdir(directory) if TEMP_MARK in n]


def test_fail_after_n_bytes_writer_fails(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        w = FailAfterNBytes(f, 5)
        w.write(b"abc")
        with pytest.raises(OSError):
            w.write(b"defg")
    assert (tmp_path / "f").read_bytes() == b"abcde"


@pytest.mark.parametrize("which", ["model.003.pt", "model.003.opt.pt", "model.003.manifest.json"])
def test_crash_while_saving_keeps_previous(tmp_model_prefix, monkeypatch, which):
    save(tmp_model_prefix, 1)
    e2 = save(tmp_model_prefix, 2)
    before = digests(e2)
    left = crash_writes_after(monkeypatch, 100, match=lambda p: os.path.basename(p) == which)
    with pytest.raises(InjectedCrash):
        save(tmp_model_prefix, 3)
    monkeypatch.undo()
    assert left and all(os.path.exists(t) for t in left)  # the "dead process" left its temp file
    assert digests(e2) == before
    assert not [c for c in ck.list_checkpoints(str(tmp_model_prefix)) if c.epoch == 3 and c.complete]
    assert not os.path.exists(str(tmp_model_prefix) + ".003.manifest.json")
    latest = ck.latest(str(tmp_model_prefix))
    assert latest.epoch == 2
    model_file, train_state = ck.load_checkpoint(latest)
    assert torch.equal(model_file["model"]["0.weight"], make_state(2)[0]["0.weight"])
    # the next save removes the stale temp file
    save(tmp_model_prefix, 3)
    assert temp_files(tmp_model_prefix.parent) == []
    assert ck.latest(str(tmp_model_prefix)).epoch == 3


def test_write_error_cleans_up_and_raises(tmp_model_prefix, monkeypatch):
    e1 = save(tmp_model_prefix, 1)
    before = digests(e1)
    failed = fail_writes_after(monkeypatch, 1000, match=lambda p: ".002." in p)
    with pytest.raises(OSError, match="No space"):
        save(tmp_model_prefix, 2)
    assert failed
    assert temp_files(tmp_model_prefix.parent) == []
    assert digests(e1) == before and ck.latest(str(tmp_model_prefix)).epoch == 1


def _damage_cases():
    return {
        "truncated model": lambda c: truncate_file(c.path, 0.5),
        "truncated opt": lambda c: truncate_file(c.opt_path, 0.9),
        "flipped byte model": lambda c: flip_byte(c.path),
        "flipped byte opt": lambda c: flip_byte(c.opt_path, -100),
        "missing opt": lambda c: os.unlink(c.opt_path),
        "missing model": lambda c: os.unlink(c.path),
        "missing manifest": lambda c: os.unlink(c.manifest_path),
        "bad manifest": lambda c: open(c.manifest_path, "w").write("{not json"),
    }


@pytest.mark.parametrize("case", list(_damage_cases()))
def test_damaged_checkpoint_detected_and_skipped(tmp_model_prefix, case, caplog):
    save(tmp_model_prefix, 1)
    e2 = save(tmp_model_prefix, 2)
    _damage_cases()[case](e2)
    e2 = next(c for c in ck.list_checkpoints(str(tmp_model_prefix)) if c.epoch == 2)
    with pytest.raises(kit.CorruptCheckpointError) as info:
        ck.verify(e2)
    assert "model.002" in str(info.value)
    if "truncated" in case:
        assert "truncated" in str(info.value)
    with pytest.raises(kit.CorruptCheckpointError):
        ck.load_checkpoint(e2)
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert ck.latest(str(tmp_model_prefix)).epoch == 1
    assert any("model.002" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kit"):
        ckpt, model_file, train_state = ck.load_latest(str(tmp_model_prefix))
    assert ckpt.epoch == model_file["epoch"] == train_state["progress"]["epoch"] == 1
    assert any("model.002" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert ck.latest(str(tmp_model_prefix), verify=False).epoch == (
        1 if "manifest" in case and "bad" not in case else 2
    )


def test_a_flipped_byte_inside_tensor_data_is_caught_although_torch_loads_it(tmp_model_prefix):
    save(tmp_model_prefix, 1)
    e2 = save(tmp_model_prefix, 2)
    with open(e2.path, "rb") as f:
        data = f.read()
    at = data.index(make_state(2)[0]["0.weight"].numpy().tobytes()[:64]) + 10  # inside a weight
    flip_byte(e2.path, at)
    torch.load(e2.path, weights_only=True)  # torch does not notice: only the hash does
    with pytest.raises(kit.CorruptCheckpointError, match="sha256"):
        ck.load_checkpoint(e2)
    assert ck.load_latest(str(tmp_model_prefix))[0].epoch == 1


def test_resume_reads_each_checkpoint_file_once(tmp_model_prefix, monkeypatch):
    kit.Session(tiny_config(str(tmp_model_prefix), num_epochs=2)).train()
    hashed = []
    real = ck.hashing.sha256_of
    monkeypatch.setattr(ck.hashing, "sha256_of", lambda path: hashed.append(os.path.basename(path)) or real(path))
    resumed = kit.Session(tiny_config(str(tmp_model_prefix), num_epochs=3))
    resumed.train_step()  # resumes from epoch 2: verified while loaded, not before as well
    assert resumed.epoch == 3 and sorted(hashed) == ["model.002.opt.pt", "model.002.pt"]
    hashed.clear()
    resumed.reload_latest()  # no weights kept in memory: back to the newest checkpoint
    assert (resumed.epoch, resumed.step_in_epoch) == (3, 0)
    assert sorted(hashed) == ["model.002.opt.pt", "model.002.pt"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: truncate_file(p, 0.5),
        lambda p: truncate_file(p, 10),
        lambda p: flip_byte(p, 100),
        lambda p: open(p, "wb").close(),
    ],
)
def test_direct_load_of_damaged_file_is_corrupt_error(tmp_path, damage):
    path = str(tmp_path / "x.pt")
    torch.save({"model": {"w": torch.arange(1000.0)}, "tag": "hello"}, path)
    damage(path)
    with pytest.raises(kit.CorruptCheckpointError, match="x.pt"):
        ck.load(path)


def test_load_missing_file(tmp_path):
    with pytest.raises(kit.CorruptCheckpointError, match="not found"):
        ck.load(str(tmp_path / "nope.pt"))


@pytest.mark.parametrize("payload", ["os.system", "touch"])
def test_malicious_pickle_refused_everywhere(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = write_malicious_checkpoint(tmp_path / "evil.pt", marker, payload)
    expected_global = "system" if payload == "os.system" else "touch_marker"
    with pytest.raises(kit.UnsafeCheckpointError, match=expected_global):
        ck.load(path)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(kit.UnsafeCheckpointError, match=expected_global):
        ck.preload_from_files(model, {"x": {"filename": path, "init_for_train": True}})
    # a "checkpoint" whose model file was replaced: the manifest matches, the refusal still holds
    prefix = str(tmp_path / "model")
    c = ck.save(prefix, epoch=1, model_state={"w": torch.zeros(2)}, train_state={"a": 1}, global_train_step=1)
    write_malicious_checkpoint(c.opt_path, marker, payload)
    import json

    manifest = json.load(open(c.manifest_path))
    manifest["files"]["train_state"].update(
        size=os.path.getsize(c.opt_path), sha256=hashlib.sha256(open(c.opt_path, "rb").read()).hexdigest()
    )
    json.dump(manifest, open(c.manifest_path, "w"))
    ck.verify(c)
    with pytest.raises(kit.UnsafeCheckpointError):
        ck.load_checkpoint(c)
    assert not marker.exists()


def test_unsafe_trust_loads_trusted_file(tmp_path, caplog):
    marker = tmp_path / "harmless"
    path = write_malicious_checkpoint(tmp_path / "trusted.pt", marker, payload="touch")
    with caplog.at_level(logging.WARNING, logger="kit"):
        obj = ck.load(path, unsafe_trust=True)
    assert marker.exists() and obj["epoch"] == 1
    assert "unsafe_trust" in caplog.text


def test_torch_load_only_in_one_place():
    import ast
    import pathlib

    calls = []
    for path in pathlib.Path(ck.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                calls.append((path.name, ast.unparse(node)))
    assert len(calls) == 1, calls
    assert "weights_only=not unsafe_trust" in calls[0][1]


_SLOW_SAVE = textwrap.dedent("""
    import sys, torch, kit.checkpoints as ck
    torch.manual_seed(2)
    model = torch.nn.Linear(256, 256)
    print("saving", flush=True)
    ck.save(sys.argv[1], epoch=2, model_state=model.state_dict(), train_state={"x": torch.ones(3)},
            global_train_step=20)
    print("saved", flush=True)
""")


def test_kill_9_during_save(tmp_model_prefix):
    e1 = save(tmp_model_prefix, 1)
    before = digests(e1)
    env = {**os.environ, "KIT_TEST_SLOW_WRITE_SECS": "30"}
    code = slow_writes.code(str(Path(__file__).resolve().parent)) + "\n" + _SLOW_SAVE
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_model_prefix)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 20
        while not temp_files(tmp_model_prefix.parent):  # inside the (slowed) write of the model file
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert temp_files(tmp_model_prefix.parent)  # the killed writer left its temp file ...
    latest = ck.latest(str(tmp_model_prefix))
    assert latest.epoch == 1 and digests(latest) == before
    ck.verify(latest)
    assert not [c for c in ck.list_checkpoints(str(tmp_model_prefix)) if c.epoch == 2 and c.complete]
    save(tmp_model_prefix, 2)  # ... which the next save removes
    assert temp_files(tmp_model_prefix.parent) == []


# ---- every code-carrying file format on every load path --------------------------------------------


def _plant(prefix: str, marker, kind: str, which: int, *, fix_manifest: bool = True) -> None:
    """Epoch 1 good, epoch 2's model (0) or training-state (1) file replaced by a code-carrying file."""
    from helpers.models import TinyModel

    for epoch in (1, 2):
        ck.save(prefix, epoch=epoch, model_state=TinyModel().state_dict(), train_state={"progress": {}},
                global_train_step=epoch)
    paths = ck.checkpoint_paths(prefix, 2)
    tmp = write_code_carrying_file(paths[which] + ".payload", marker, kind)
    os.replace(tmp, paths[which])
    if fix_manifest:  # only unpickling can tell
        import json

        manifest = json.loads(open(paths[2]).read())
        data = open(paths[which], "rb").read()
        manifest["files"]["model" if which == 0 else "train_state"].update(
            size=len(data), sha256=hashlib.sha256(data).hexdigest())
        open(paths[2], "w").write(json.dumps(manifest))


def _engine_with(tmp_path, **keys):
    return Engine(kit.Config(tiny_config(str(tmp_path / "run" / "model"), **keys)))


def _load_paths(tmp_path, kind, marker):
    """name -> a call that must raise UnsafeCheckpointError for a ``kind`` file."""
    evil = write_code_carrying_file(tmp_path / "evil.pt", marker, kind)
    prefix = str(tmp_path / "ckpt" / "model")

    def resumed(task=None):
        def run():
            _plant(prefix, marker, kind, 0)
            engine = Engine(kit.Config(tiny_config(prefix)))
            if task:
                engine.task = task
            engine.setup()
        return run

    def eval_load():
        engine = _engine_with(tmp_path, load=evil)
        engine.task = "eval"
        engine.setup()

    paths = {
        "checkpoints.load": lambda: ck.load(evil),
        "preload_from_files": lambda: ck.preload_from_files(
            torch.nn.Linear(2, 2), {"x": {"filename": evil, "init_for_train": True}}),
        "config load": lambda: _engine_with(tmp_path, load=evil).setup(),
        "config import_model_train_epoch1": lambda: _engine_with(tmp_path, import_model_train_epoch1=evil).setup(),
        "config load (eval)": eval_load,
    }
    if kind == "pickle-in-safetensors":  # a checkpoint's files are .pt: planted there, it is a plain pickle
        return paths

    def load_checkpoint(which, fix=True):
        def run():
            _plant(prefix, marker, kind, which, fix_manifest=fix)
            ck.load_checkpoint(next(c for c in ck.list_checkpoints(prefix) if c.epoch == 2))
        return run

    def load_latest(fix):
        def run():
            _plant(prefix, marker, kind, 0, fix_manifest=fix)
            ck.load_latest(prefix)  # must stop, not fall back to epoch 1
        return run

    paths.update({
        "load_checkpoint model file": load_checkpoint(0),
        "load_checkpoint training state": load_checkpoint(1),
        "load_latest (manifest matches)": load_latest(True),
        "load_latest (manifest does not match)": load_latest(False),
        "resume (newest checkpoint)": resumed(),
        "eval (newest checkpoint)": resumed("eval"),
    })
    return paths


_PAYLOAD_TALLY: dict[str, list[str]] = {"tried": [], "executed": [], "not refused": []}


@pytest.mark.parametrize("kind", CODE_CARRYING_KINDS)
def test_every_code_carrying_file_is_refused_on_every_load_path(tmp_path, kind):
    marker = tmp_path / "pwned"
    refused_wrongly = []
    for name, call in _load_paths(tmp_path, kind, marker).items():
        _PAYLOAD_TALLY["tried"].append(f"{kind} / {name}")
        try:
            call()
        except kit.UnsafeCheckpointError as e:
            assert "could run code" in str(e) or "carries code" in str(e) or "code execution" in str(e) \
                or "not unpickled" in str(e) or "safetensors" in str(e), (name, str(e))
        except Exception as e:  # noqa: BLE001 - collected and reported below
            refused_wrongly.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        else:
            refused_wrongly.append(f"{name}: loaded")
        if marker.exists():
            _PAYLOAD_TALLY["executed"].append(f"{kind} / {name}")
            marker.unlink()
    _PAYLOAD_TALLY["not refused"] += refused_wrongly
    print(f"\ncode-carrying files: {len(_PAYLOAD_TALLY['executed'])} executed, "
          f"{len(_PAYLOAD_TALLY['not refused'])} not refused as unsafe, of {len(_PAYLOAD_TALLY['tried'])} tried")
    assert not _PAYLOAD_TALLY["executed"]
    assert not refused_wrongly, refused_wrongly


def test_the_code_carrying_scan_passes_kit_and_torch_files(tmp_path):
    """Negative control: ordinary files (zip and legacy format, plain pickles of data) are not called unsafe."""
    import pickle

    from kit.checkpoints.safety import code_carrying_reason

    torch.save({"model": {"w": torch.arange(3.0)}, "n": 1}, tmp_path / "zip.pt")
    torch.save({"model": {"w": torch.arange(3.0)}}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with open(tmp_path / "data.pkl", "wb") as f:
        pickle.dump({"a": [1, 2.0, "x"]}, f, protocol=4)
    for name in ("zip.pt", "old.pt", "data.pkl"):
        assert code_carrying_reason(str(tmp_path / name)) is None, name
    with open(tmp_path / "p4.pt", "wb") as f:  # torch refuses protocol 4; kit says corrupt, not unsafe
        pickle.dump({"a": 1}, f, protocol=4)
    with pytest.raises(kit.CorruptCheckpointError) as info:
        ck.load(str(tmp_path / "p4.pt"))
    assert not isinstance(info.value, kit.UnsafeCheckpointError)
