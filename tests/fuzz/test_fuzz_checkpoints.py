"""Fuzzing checkpoints and their manifests: the newest checkpoint's data exactly as written, an older one's
exactly as written (after a warning), or a kit error naming the file — never other data or a raw exception."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from fuzzlib import MUTATIONS, canonical, mutate, outcome
from hypothesis import given, settings
from hypothesis import strategies as st

import kit.checkpoints as ck
from kit.checkpoints.manifest import manifest_problem, read_manifest_file

CASES = 150


def _state(epoch: int) -> tuple[dict, dict]:
    torch.manual_seed(epoch)
    weights = {"w": torch.randn(4, 3), "b": torch.randn(3), "steps": torch.tensor(epoch)}
    train = {"progress": {"epoch": epoch + 1, "global_train_step": 10 * epoch}, "rng": {"seed": epoch},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(4, 3)}}, "param_groups": [{"lr": 0.1}]}}
    return weights, train


STATES = {e: _state(e) for e in (1, 2)}


def _written() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "model")
        for epoch, (weights, train) in STATES.items():
            ck.save(prefix, epoch=epoch, model_state=weights, train_state=train, global_train_step=10 * epoch)
        return {name: open(os.path.join(tmp, name), "rb").read() for name in sorted(os.listdir(tmp))}


FILES = _written()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _run_dir(tmp_path, name: str, data: bytes):
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    for file, content in FILES.items():
        (run / file).write_bytes(data if file == name else content)
    return run


def _check_resume(run, damaged: str) -> None:
    kind, value = outcome(lambda: ck.load_latest(str(run / "model")), run / damaged)
    if kind == "error":
        return
    assert value is not None, "no checkpoint at all, though epoch 1 is intact"
    ckpt, model_file, train = value
    weights, expected_train = STATES[ckpt.epoch]
    assert _equal(model_file["model"], weights), f"epoch {ckpt.epoch}: other weights than written"
    assert _equal(train, expected_train), f"epoch {ckpt.epoch}: another training state than written"


@settings(max_examples=CASES)
@given(name=st.sampled_from(["model.002.pt", "model.002.opt.pt"]), mutations=MUTATIONS)
def test_fuzz_newest_checkpoint_files(tmp_path, name, mutations):
    """Damaged model / training-state files of the newest checkpoint (its manifest intact)."""
    _check_resume(_run_dir(tmp_path, name, mutate(FILES[name], mutations)), name)


@settings(max_examples=CASES)
@given(mutations=MUTATIONS)
def test_fuzz_manifest(tmp_path, mutations):
    """A damaged manifest: read alone it is refused or exactly what its bytes say; a resume gets intact data."""
    data = mutate(FILES["model.002.manifest.json"], mutations)
    run = _run_dir(tmp_path, "model.002.manifest.json", data)
    path = run / "model.002.manifest.json"
    kind, value = outcome(lambda: read_manifest_file(str(path)), path)
    if kind == "value":
        assert manifest_problem(value) is None
        assert canonical(value) == canonical(json.loads(data.decode("utf-8")))
    _check_resume(run, "model.002.manifest.json")


@settings(max_examples=CASES)
@given(mutations=MUTATIONS)
def test_fuzz_foreign_torch_file(tmp_path, mutations):
    """A torch file without a manifest (e.g. RETURNN's): loaded safely or refused; never a raw exception.

    Nothing vouches for its bytes, so a flipped bit inside a tensor may load as another value; the loader
    must still end with a kit error or an object, within the time and memory limits."""
    path = tmp_path / "returnn.pt"
    path.write_bytes(mutate(FILES["model.001.pt"], mutations))
    outcome(lambda: ck.load(str(path)), path)


def test_the_unmutated_run_resumes_from_the_newest(tmp_path):  # the negative control of the property
    run = _run_dir(tmp_path, "", b"")
    ckpt, model_file, train = ck.load_latest(str(run / "model"))
    assert ckpt.epoch == 2 and _equal(model_file["model"], STATES[2][0]) and _equal(train, STATES[2][1])
