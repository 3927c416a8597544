"""Bad inputs that once gave raw Python errors now give kit errors naming the key or the file."""

from __future__ import annotations

import io
import logging
import struct
import zipfile

import pytest
import torch
from helpers.models import tiny_config

import kit
import kit.checkpoints as ck
from kit.data.distrib_files import DistributeFilesDataset
from kit.errors import CheckpointError, ConfigError, CorruptCheckpointError, ScoreFileError
from kit.scores import MAX_SCORE_FILE_BYTES, ScoreTable


def _storage_numel(path, numel: int) -> None:
    """Rewrite the torch file at ``path`` so that its 7-element storage claims ``numel`` elements."""
    src = zipfile.ZipFile(io.BytesIO(open(path, "rb").read()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"K\x07" in data
                data = data.replace(b"K\x07", b"J" + struct.pack("<i", numel), 1)
            out.writestr(info, data)


def test_a_storage_of_negative_size_is_a_corrupt_checkpoint(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"model": {"w": torch.arange(7.0)}}, path)
    assert kit.checkpoints.load(str(path))["model"]["w"].numel() == 7  # negative control
    _storage_numel(path, -5)
    with pytest.raises(CorruptCheckpointError, match="w.pt"):
        kit.checkpoints.load(str(path))


def test_a_newest_checkpoint_with_a_bad_storage_is_skipped_with_a_warning(tmp_path, caplog):
    prefix = str(tmp_path / "model")
    for epoch in (1, 2):
        ck.save(prefix, epoch=epoch, model_state={"w": torch.arange(7.0) + epoch}, train_state=None,
                global_train_step=epoch)
    _storage_numel(f"{prefix}.002.pt", -5)
    # the manifest's size and digest are rewritten to match: the file is damaged "by design", not torn
    import hashlib
    import json
    manifest_path = f"{prefix}.002.manifest.json"
    manifest = json.loads(open(manifest_path).read())
    data = open(f"{prefix}.002.pt", "rb").read()
    manifest["files"]["model"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    open(manifest_path, "w").write(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="kit"):
        ckpt, model_file, _ = ck.load_latest(prefix)
    assert ckpt.epoch == 1 and torch.equal(model_file["model"]["w"], torch.arange(7.0) + 1)
    assert "Skipping checkpoint model.002" in caplog.text


def test_a_huge_score_file_is_refused_naming_the_file_and_why(tmp_path):
    path = tmp_path / "scores.json"
    with open(path, "wb") as f:
        f.truncate(MAX_SCORE_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ScoreFileError, match=r"scores.json.*bytes, more than kit reads.*100,000 epochs"):
        ScoreTable.load(path)


def test_a_missing_distributed_file_is_named_at_start(tmp_path):
    there = tmp_path / "a.txt"
    there.write_text("x")
    with pytest.raises(ConfigError, match=r"b.txt.*entry 1 of 'files'.*does not exist"):
        DistributeFilesDataset(files=[str(there), str(tmp_path / "b.txt")], get_sub_epoch_dataset=lambda f: {})


def test_a_py_file_list_with_code_says_plainly_that_it_was_not_run(tmp_path):
    listing = tmp_path / "files.py"
    listing.write_text("[__import__('os').system('echo hi')]\n")
    with pytest.raises(ConfigError, match=r"files.py.*holds code.*which kit never runs") as info:
        DistributeFilesDataset(files=str(listing), get_sub_epoch_dataset=lambda f: {})
    assert "0x" not in str(info.value)


def test_num_workers_of_the_wrong_type_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"torch_dataloader_opts.*'num_workers' to be an int >= 0"):
        kit.Config(tiny_config(torch_dataloader_opts={"num_workers": "two"}))


def test_checkpoints_find_with_a_bad_step_names_the_form(tmp_path):
    with kit.Session(**tiny_config(str(tmp_path / "model"))) as session:
        with pytest.raises(CheckpointError, match=r"step:abc.*e.g. 'step:1250'"):
            session.checkpoints.find("step:abc")
        with pytest.raises(CheckpointError, match="no checkpoint"):  # a well-formed one that is not there
            session.checkpoints.find("step:12")
