"""Checkpoint files: naming, round trip, manifest, latest, cleanup, preload, in-place loading, safetensors."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import kit
import kit.checkpoints as ck
from kit.rng import get_rng_state


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(4, 3)
        self.dec = torch.nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(()))


def make_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def train_state_of(model: torch.nn.Module) -> dict:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model.dec(model.enc(torch.randn(5, 4))).sum()
    loss.backward()
    opt.step()
    return {
        "optimizer": opt.state_dict(),
        "progress": {"epoch": 2, "step_in_epoch": 7, "data_pos": [3, 9]},
        "rng": get_rng_state(),
        "lr_control": {"name": "newbob", "values": [0.1, 0.05]},
    }


def save_epoch(prefix, epoch, model=None, step=None, kind="epoch", train_state=True):
    model = model or make_model(epoch)
    return ck.save(
        str(prefix),
        epoch=epoch,
        model_state=model.state_dict(),
        train_state=train_state_of(model) if train_state else None,
        global_train_step=step if step is not None else epoch * 100,
        kind=kind,
    )


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---- naming and round trip


def test_naming_epoch_and_step(tmp_model_prefix):
    e = save_epoch(tmp_model_prefix, 3)
    s = save_epoch(tmp_model_prefix, 4, step=1250, kind="step")
    assert os.path.basename(e.path) == "model.003.pt"
    assert os.path.basename(e.opt_path) == "model.003.opt.pt"
    assert os.path.basename(e.manifest_path) == "model.003.manifest.json"
    assert os.path.basename(s.path) == "model.004.step00001250.pt"
    assert os.path.basename(s.opt_path) == "model.004.step00001250.opt.pt"
    assert os.path.basename(s.manifest_path) == "model.004.step00001250.manifest.json"
    assert sorted(os.listdir(tmp_model_prefix.parent)) == sorted(
        os.path.basename(p) for c in (e, s) for p in (c.path, c.opt_path, c.manifest_path)
    )
    assert [
        (c.epoch, c.global_train_step, c.kind, c.complete) for c in ck.list_checkpoints(str(tmp_model_prefix))
    ] == [(3, 300, "epoch", True), (4, 1250, "step", True)]


def test_round_trip_weights_only(tmp_model_prefix, monkeypatch):
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    model = make_model(1)
    state = train_state_of(model)
    saved = ck.save(
        str(tmp_model_prefix),
        epoch=2,
        model_state=model.state_dict(),
        train_state=state,
        global_train_step=77,
        effective_learning_rate=0.5,
        config_digest="abc",
        extra_meta={"x": 1},
    )
    model_file, loaded_state = ck.load_checkpoint(saved)
    assert_same(model_file["model"], model.state_dict())
    assert (model_file["epoch"], model_file["step"], model_file["effective_learning_rate"]) == (2, 77, 0.5)
    assert model_file["kit_version"] == kit.__version__
    assert_same(loaded_state, state)
    assert calls and all(kw.get("weights_only") is True for kw in calls)
    manifest = saved.manifest()
    assert manifest["config_digest"] == "abc" and manifest["extra"] == {"x": 1}
    assert manifest["files"]["model"]["size"] == os.path.getsize(saved.path)
    assert manifest["torch_version"] == torch.__version__ and manifest["global_train_step"] == 77
    # without the training state: the opt file is not even read
    _, none_state = ck.load_checkpoint(saved, load_train_state=False)
    assert none_state is None


def test_rng_state_round_trip_restores_streams(tmp_model_prefix):
    from kit.rng import set_rng_state

    torch.manual_seed(5)
    snap = get_rng_state()
    expected = torch.rand(3)
    c = ck.save(
        str(tmp_model_prefix), epoch=1, model_state={}, train_state={"rng": snap}, global_train_step=1
    )
    torch.rand(10)
    set_rng_state(ck.load_checkpoint(c)[1]["rng"])
    assert torch.equal(torch.rand(3), expected)


def test_save_without_train_state(tmp_model_prefix):
    c = save_epoch(tmp_model_prefix, 1, train_state=False)
    assert not os.path.exists(c.opt_path)
    ck.verify(c)
    assert ck.load_checkpoint(c)[1] is None


def test_extra_meta_must_be_json(tmp_model_prefix):
    with pytest.raises(kit.CheckpointError, match="extra_meta"):
        ck.save(
            str(tmp_model_prefix),
            epoch=1,
            model_state={},
            train_state=None,
            global_train_step=1,
            extra_meta={"t": torch.zeros(1)},
        )
    assert ck.list_checkpoints(str(tmp_model_prefix)) == []


def test_checkpoint_helpers(tmp_model_prefix):
    c = save_epoch(tmp_model_prefix, 1)
    assert c.exists and c.name == "model.001"
    assert c.size == os.path.getsize(c.path) + os.path.getsize(c.opt_path)
    assert c.mtime is not None and "epoch 1" in str(c)


# ---- manifest and latest


def test_manifest_written_last(tmp_model_prefix, monkeypatch):
    save_epoch(tmp_model_prefix, 1)
    order = []
    real_open = kit.fileio.atomic_open
    monkeypatch.setattr(
        kit.fileio, "atomic_open", lambda p, m="wb": order.append(os.path.basename(p)) or real_open(p, m)
    )
    save_epoch(tmp_model_prefix, 2)
    assert order == ["model.002.pt", "model.002.opt.pt", "model.002.manifest.json"]


def test_failure_before_manifest_leaves_incomplete(tmp_model_prefix, monkeypatch, caplog):
    save_epoch(tmp_model_prefix, 1)

    def boom(path, manifest):
        raise OSError("disk gone")

    monkeypatch.setattr(ck.files, "_write_manifest", boom)
    with pytest.raises(OSError):
        save_epoch(tmp_model_prefix, 2)
    both = ck.list_checkpoints(str(tmp_model_prefix))
    assert [(c.epoch, c.complete) for c in both] == [(1, True), (2, False)]
    assert os.path.exists(both[1].path) and os.path.exists(both[1].opt_path)  # the files are there ...
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert ck.latest(str(tmp_model_prefix)).epoch == 1  # ... but it does not count
    assert "model.002" in caplog.text


def test_latest_orders_by_step_then_kind(tmp_model_prefix):
    p = str(tmp_model_prefix)
    assert ck.latest(p) is None
    save_epoch(p, 1, step=100)
    save_epoch(p, 2, step=150, kind="step")
    assert ck.latest(p).kind == "step"
    save_epoch(p, 2, step=200, kind="step")
    save_epoch(p, 2, step=200)  # the epoch-end checkpoint at the same step wins
    assert (ck.latest(p).epoch, ck.latest(p).kind) == (2, "epoch")
    save_epoch(p, 3, step=230, kind="step")
    assert ck.latest(p).global_train_step == 230
    assert [c.global_train_step for c in ck.list_checkpoints(p)] == [100, 150, 200, 200, 230]


def test_resave_same_name_replaces(tmp_model_prefix):
    save_epoch(tmp_model_prefix, 1, model=make_model(1))
    model = make_model(2)
    c = save_epoch(tmp_model_prefix, 1, model=model, train_state=False)
    ck.verify(c)
    assert_same(ck.load_checkpoint(c)[0]["model"], model.state_dict())
    assert not os.path.exists(c.opt_path)  # the old training state does not linger


# ---- load_into_model


def test_load_into_model_in_place():
    model, other = make_model(0), make_model(1)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    ck.load_into_model(model, other.state_dict())
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert_same(model.state_dict(), other.state_dict())


def test_load_into_model_missing_and_unexpected(caplog):
    model = make_model(0)
    sd = make_model(1).state_dict()
    del sd["dec.bias"]
    sd["extra.w"] = torch.zeros(1)
    with pytest.raises(kit.CheckpointError, match="dec.bias"):
        ck.load_into_model(model, sd)
    with caplog.at_level(logging.INFO, logger="kit"):
        ck.load_into_model(model, sd, strict=False)
    assert "extra.w" in caplog.text
    sd = make_model(1).state_dict()
    sd["enc.weight"] = torch.zeros(5, 5)
    with pytest.raises(kit.CheckpointError, match="enc.weight"):
        ck.load_into_model(model, sd)


# ---- safetensors


def test_safetensors_export_and_load(tmp_path):
    model = make_model(3)
    path = ck.export_safetensors(model, str(tmp_path / "w.safetensors"))
    assert_same(ck.load(path), model.state_dict())
    with open(path, "rb") as f:
        assert f.read(2) != b"PK"


def test_fake_safetensors_rejected(tmp_path):
    marker = tmp_path / "marker"
    from helpers.faults import write_malicious_checkpoint

    path = write_malicious_checkpoint(tmp_path / "evil.safetensors", marker)
    with pytest.raises((kit.CorruptCheckpointError, kit.UnsafeCheckpointError), match="safetensors"):
        ck.load(path)
    assert not marker.exists()
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!!")
    with pytest.raises(kit.CorruptCheckpointError):
        ck.load(str(tmp_path / "junk.safetensors"))


# ---- cleanup


def _epochs(prefix):
    return [c.epoch for c in ck.list_checkpoints(str(prefix))]


def test_cleanup_keep_last_and_best(tmp_model_prefix):
    for e in range(1, 9):
        save_epoch(tmp_model_prefix, e)
    scores = {e: {"dev_ce": v} for e, v in zip(range(1, 9), [5, 1, 4, 2, 6, 7, 8, 9])}
    removed = ck.cleanup(
        str(tmp_model_prefix), {"keep_last_n": 2, "keep_best_n": 1, "keep": [3]}, scores=scores
    )
    assert [c.epoch for c in removed] == [1, 4, 5, 6]
    assert _epochs(tmp_model_prefix) == [2, 3, 7, 8]
    names = os.listdir(tmp_model_prefix.parent)
    assert not any(n.startswith(("model.001.", "model.004.")) for n in names)  # opt files and manifests too


def test_cleanup_defaults_and_best_dict(tmp_model_prefix):
    for e in range(1, 9):
        save_epoch(tmp_model_prefix, e)
    scores = {e: {"a": float(e), "b": float(-e)} for e in range(1, 9)}
    ck.cleanup(str(tmp_model_prefix), True, scores=scores)  # last 2 + best 4 per key
    assert _epochs(tmp_model_prefix) == [1, 2, 3, 4, 5, 6, 7, 8]
    ck.cleanup(str(tmp_model_prefix), {"keep_last_n": 1, "keep_best_n": {"a": 2}}, scores=scores)
    assert _epochs(tmp_model_prefix) == [1, 2, 8]
    assert ck.cleanup(str(tmp_model_prefix), False) == []


def test_cleanup_dry_run_and_never_newest(tmp_model_prefix):
    for e in range(1, 5):
        save_epoch(tmp_model_prefix, e)
    before = sorted(os.listdir(tmp_model_prefix.parent))
    would = ck.cleanup(str(tmp_model_prefix), {"keep_last_n": 0, "keep_best_n": 0, "dry_run": True})
    assert [c.epoch for c in would] == [1, 2, 3]
    assert sorted(os.listdir(tmp_model_prefix.parent)) == before
    protect = [c for c in ck.list_checkpoints(str(tmp_model_prefix)) if c.epoch == 2]
    ck.cleanup(str(tmp_model_prefix), {"keep_last_n": 0, "keep_best_n": 0}, protect=protect)
    assert _epochs(tmp_model_prefix) == [2, 4]


def test_cleanup_step_checkpoints(tmp_model_prefix):
    p = str(tmp_model_prefix)
    save_epoch(p, 1, step=100)
    save_epoch(p, 2, step=150, kind="step")
    save_epoch(p, 2, step=200)
    save_epoch(p, 3, step=220, kind="step")
    save_epoch(p, 3, step=240, kind="step")
    save_epoch(p, 3, step=260, kind="step")
    ck.cleanup(p, {"keep_last_n": 2})
    assert [(c.epoch, c.kind, c.global_train_step) for c in ck.list_checkpoints(p)] == [
        (1, "epoch", 100),
        (2, "epoch", 200),
        (3, "step", 240),
        (3, "step", 260),
    ]


def test_cleanup_unknown_option(tmp_model_prefix):
    with pytest.raises(kit.ConfigError, match="keep_lastn"):
        ck.cleanup(str(tmp_model_prefix), {"keep_lastn": 2})


def test_delete_removes_manifest_first(tmp_model_prefix, monkeypatch):
    save_epoch(tmp_model_prefix, 1)
    c2 = save_epoch(tmp_model_prefix, 2)
    real_unlink = os.unlink
    deleted = []

    def crash_after_manifest(path, *a, **kw):
        if deleted:
            raise KeyboardInterrupt("crash")  # dies right after the first removal
        real_unlink(path, *a, **kw)
        deleted.append(os.path.basename(path))

    monkeypatch.setattr(os, "unlink", crash_after_manifest)
    with pytest.raises(KeyboardInterrupt):
        ck.delete(c2)
    monkeypatch.undo()
    assert deleted == ["model.002.manifest.json"]
    assert os.path.exists(c2.path)  # files still there, but it no longer counts
    assert ck.latest(str(tmp_model_prefix)).epoch == 1
    # the leftover is removed by the next cleanup (it is older than a newer complete one)
    save_epoch(tmp_model_prefix, 3)
    ck.cleanup(str(tmp_model_prefix), {"keep_last_n": 5})
    assert _epochs(tmp_model_prefix) == [1, 3]


def test_cleanup_keeps_incomplete_newest(tmp_model_prefix, monkeypatch):
    save_epoch(tmp_model_prefix, 1)
    save_epoch(tmp_model_prefix, 2)
    monkeypatch.setattr(ck.files, "_write_manifest", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        save_epoch(tmp_model_prefix, 3)
    monkeypatch.undo()
    ck.cleanup(str(tmp_model_prefix), {"keep_last_n": 0, "keep_best_n": 0})
    assert [(c.epoch, c.complete) for c in ck.list_checkpoints(str(tmp_model_prefix))] == [
        (2, True),
        (3, False),
    ]


# ---- preload_from_files and hooks


class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Tiny()
        self.out = torch.nn.Linear(2, 2)


@pytest.fixture
def tiny_file(tmp_path):
    src = make_model(7)
    c = ck.save(
        str(tmp_path / "src"), epoch=1, model_state=src.state_dict(), train_state=None, global_train_step=1
    )
    return src, c.path


def test_preload_with_prefix(tiny_file):
    src, path = tiny_file
    big = Big()
    out_before = big.out.weight.clone()
    loaded = ck.preload_from_files(
        big, {"enc": {"filename": path, "prefix": "encoder.", "init_for_train": True}}
    )
    assert loaded == sorted("encoder." + k for k in src.state_dict())
    assert_same(big.encoder.state_dict(), src.state_dict())
    assert torch.equal(big.out.weight, out_before)


def test_preload_init_for_train_semantics(tiny_file):
    src, path = tiny_file
    model = make_model(0)
    assert ck.preload_from_files(model, {"a": {"filename": path}}, is_training_start=True) == []
    assert not torch.equal(model.enc.weight, src.enc.weight)
    assert (
        ck.preload_from_files(
            model, {"a": {"filename": path, "init_for_train": True}}, is_training_start=False
        )
        == []
    )
    assert ck.preload_from_files(model, {"a": {"filename": path}}, is_training_start=False)
    assert torch.equal(model.enc.weight, src.enc.weight)


def test_preload_ignore_and_mapping(tiny_file, tmp_path):
    src, path = tiny_file
    model = make_model(0)
    keep = model.dec.weight.clone(), model.enc.bias.clone()
    ck.preload_from_files(
        model,
        {
            "a": {
                "filename": path,
                "init_for_train": True,
                "ignore_params": ["dec.weight"],
                "ignore_params_prefixes": ["enc.b"],
                "ignore_missing": True,
            }
        },
    )
    assert torch.equal(model.dec.weight, keep[0]) and torch.equal(model.enc.bias, keep[1])
    assert torch.equal(model.enc.weight, src.enc.weight)
    # var_name_mapping: model name -> name in the file
    sd = dict(src.state_dict())
    sd["old_dec.bias"] = sd.pop("dec.bias")
    torch.save(sd, tmp_path / "plain.pt")
    model = make_model(0)
    ck.preload_from_files(
        model,
        {
            "a": {
                "filename": str(tmp_path / "plain.pt"),
                "checkpoint_key": None,
                "init_for_train": True,
                "var_name_mapping": {"dec.bias": "old_dec.bias"},
            }
        },
    )
    assert torch.equal(model.dec.bias, src.dec.bias)


def test_preload_missing_and_bad_prefix(tiny_file, tmp_path):
    src, path = tiny_file
    sd = dict(src.state_dict())
    del sd["dec.bias"]
    torch.save({"model": sd}, tmp_path / "partial.pt")
    entry = {"filename": str(tmp_path / "partial.pt"), "init_for_train": True}
    with pytest.raises(kit.CheckpointError, match="dec.bias"):
        ck.preload_from_files(make_model(0), {"a": entry})
    assert "dec.bias" not in ck.preload_from_files(make_model(0), {"a": {**entry, "ignore_missing": True}})
    with pytest.raises(kit.CheckpointError, match="nothing_here"):
        ck.preload_from_files(
            Big(), {"a": {"filename": path, "prefix": "nothing_here.", "init_for_train": True}}
        )


def test_load_model_post_hooks():
    seen = []
    model = make_model(0)
    ck.apply_load_model_post_hooks(model, [lambda *, model, **_: seen.append(model)])
    assert seen == [model]
    with pytest.raises(kit.ConfigError, match="kwargs"):
        ck.apply_load_model_post_hooks(model, [lambda *, model: None])


def test_manifest_is_json(tmp_model_prefix):
    c = save_epoch(tmp_model_prefix, 1)
    with open(c.manifest_path) as f:
        m = json.load(f)
    assert m["kind"] == "epoch" and m["epoch"] == 1 and len(m["files"]["train_state"]["sha256"]) == 64


# ---- RETURNN's layout: the manifest inside the model file -------------------------------------------


def _save_returnn_layout(prefix: str, epoch: int, step: int) -> ck.Checkpoint:
    return ck.save(prefix, epoch=epoch, model_state={"w": torch.full((3,), float(epoch))},
                            train_state={"progress": {"epoch": epoch}, "rng": {}}, global_train_step=step,
                            effective_learning_rate=0.5, layout="returnn")


def test_returnn_layout_writes_only_returnns_two_files_and_reads_back_verified(tmp_path):
    prefix = str(tmp_path / "model")
    _save_returnn_layout(prefix, 1, 10)
    saved = _save_returnn_layout(prefix, 2, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.001.opt.pt", "model.001.pt",
                                                           "model.002.opt.pt", "model.002.pt"]
    plain = torch.load(saved.path, weights_only=True)  # what RETURNN's loader does with it
    assert (plain["epoch"], plain["step"], plain["effective_learning_rate"]) == (2, 20, 0.5)
    last = ck.latest(prefix)
    assert (last.name, last.global_train_step, last.complete, last.embedded) == ("model.002", 20, True, True)
    model_file, state = ck.load_checkpoint(last)
    assert torch.equal(model_file["model"]["w"], torch.full((3,), 2.0)) and "kit_manifest" not in model_file
    assert state == {"progress": {"epoch": 2}, "rng": {}}


def test_returnn_layout_a_damaged_training_state_or_a_missing_model_file_falls_back(tmp_path, caplog):
    prefix = str(tmp_path / "model")
    _save_returnn_layout(prefix, 1, 10)
    second = _save_returnn_layout(prefix, 2, 20)
    data = bytearray(open(second.opt_path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(second.opt_path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert ck.latest(prefix).name == "model.001"
    assert "sha256" in caplog.text
    os.unlink(second.path)  # a save killed after its training state, before its model file
    assert [c.complete for c in ck.list_checkpoints(prefix)] == [True, False]
    assert ck.latest(prefix).name == "model.001"
    _save_returnn_layout(prefix, 2, 20)  # the next save of that name replaces kit's leftover
    assert ck.latest(prefix).name == "model.002"
