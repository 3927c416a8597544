"""RETURNN setups as their users run them today, under kit and under the installed RETURNN.

- OggZipDataset (string key ``raw``, byte keys ``orth`` / ``classes``): the same scores and weights;
- RETURNN's ``demos/demo-rf.config`` (an ``rf.Module``): the same step losses, scores and weights
  (RETURNN's frontend seeded as RETURNN seeds it), and without RETURNN one message saying what to install;
- a batch speaks RETURNN's tensor API and kit's, wherever the config imports ``returnn``;
- a relative config path gives RETURNN's run directory;
- an epoch that the length filter empties: what RETURNN does (this release stops with an error);
- every key RETURNN's torch path reads is in kit's key table (none ignored without a warning).

Skips only when RETURNN is not importable (the CI installs it through the ``returnn`` extra).
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

returnn = pytest.importorskip("returnn", reason="parity tests need RETURNN (pip install returnn)")

import kit  # noqa: E402
from kit.scores import parse_returnn_lr_file  # noqa: E402
from tests.returnn_compat.returnn_helpers import FIXTURES, NO_RETURNN, ROOT, run_python  # noqa: E402

SHARED = str(FIXTURES / "shared_run.config")


def _lr_file(path: Path) -> dict:
    return parse_returnn_lr_file(path.read_text())["epochs"]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = (torch.load(p, weights_only=True)["model"] for p in (a, b))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def _scores(lr: dict) -> dict:
    return {epoch: row["scores"] for epoch, row in lr.items()}


# ---- OggZipDataset: string keys ------------------------------------------------------------------


def test_oggzip_string_keys_train_as_in_returnn(tmp_path):
    config = str(FIXTURES / "oggzip.config")
    for runner in ("returnn", "kit"):
        (tmp_path / runner).mkdir()
        args = ["-m", "returnn", config] if runner == "returnn" else ["-m", "kit", "train", config]
        run_python(args, env={"RUN_DIR": str(tmp_path / runner)})
    want, got = _lr_file(tmp_path / "returnn" / "learning_rates"), _lr_file(tmp_path / "kit" / "learning_rates")
    assert sorted(want) == sorted(got) == [1, 2]
    assert _scores(got) == _scores(want)  # train and dev, to the last bit
    _same_weights(tmp_path / "returnn" / "model.002.pt", tmp_path / "kit" / "model.002.pt")


def test_string_key_batch_field_is_numpy_str():
    import numpy as np

    from kit.data.collate import collate
    from kit.data.extern_data import ExternData

    seqs = [{"raw": np.array("ab c"), "orth": np.array([97, 98], dtype="uint8")},
            {"raw": np.array("d\u00e4"), "orth": np.array([100], dtype="uint8")}]
    spec = ExternData({"raw": {"dtype": "string", "shape": ()}, "orth": {"dim": 256, "sparse": True, "dtype": "uint8"}})
    fields = collate(seqs, ["a", "b"], spec)
    raw = fields["raw"]
    assert isinstance(raw, kit.data.StringField) and isinstance(raw.raw_tensor, np.ndarray)
    assert raw.strings == ["ab c", "d\u00e4"] and raw.to("meta") is raw  # strings stay on the host
    assert isinstance(fields["orth"].tensor, torch.Tensor)
    batch = kit.Batch(fields, ["a", "b"], [0, 1]).select([1])
    assert batch["raw"].strings == ["d\u00e4"] and batch["orth"].lengths.tolist() == [1]
    assert "2 strings" in kit.Batch(fields, ["a", "b"], [0, 1]).summary()


# ---- RETURNN's demo-rf.config: an rf.Module from RETURNN's initial weights -------------------------


def _demo_rf(tmp_path: Path) -> Path:
    """RETURNN's demo-rf.config, smaller (50/10 sequences, 2 epochs), writing into RUN_DIR, logging step losses."""
    src = (FIXTURES / "demo-rf.config").read_text().split("\n", 1)[1]  # RETURNN wants '#!' on the first line
    edits = {
        '"num_seqs": 1000}': '"num_seqs": 50}',
        '"num_seqs": 100, "fixed_random_seed": 1}': '"num_seqs": 10, "fixed_random_seed": 1}',
        'learning_rate_file = "/tmp/%s/returnn/%s/learning_rates" % (get_login_username(), demo_name)':
            'learning_rate_file = os.environ["RUN_DIR"] + "/learning_rates"',
        'model = "/tmp/%s/returnn/%s/model" % (get_login_username(), demo_name)':
            'model = os.environ["RUN_DIR"] + "/model"\ndevice = "cpu"',
        "num_epochs = 5": "num_epochs = 2",
        '    loss.mark_as_loss(name="ce")':
            '    loss.mark_as_loss(name="ce")\n'
            '    with open(os.environ["RUN_DIR"] + "/steps", "a") as f:\n'
            '        f.write(repr(float(loss.raw_tensor.sum())) + "\\n")',
    }
    for old, new in edits.items():
        assert old in src, old
        src = src.replace(old, new)
    path = tmp_path / "demo-rf.config"
    path.write_text(src)
    return path


def test_demo_rf_config_starts_from_returnns_weights(tmp_path):
    config = str(_demo_rf(tmp_path))
    for runner in ("returnn", "kit"):
        (tmp_path / runner).mkdir()
        args = ["-m", "returnn", config] if runner == "returnn" else ["-m", "kit", "train", config]
        run_python(args, env={"RUN_DIR": str(tmp_path / runner)})
    steps_r, steps_k = ((tmp_path / r / "steps").read_text().split() for r in ("returnn", "kit"))
    assert len(steps_r) > 10 and steps_k == steps_r  # step 0 (the initial weights), every step after, the dev steps
    assert _scores(_lr_file(tmp_path / "kit" / "learning_rates")) == _scores(_lr_file(tmp_path / "returnn" / "learning_rates"))
    _same_weights(tmp_path / "returnn" / "model.002.pt", tmp_path / "kit" / "model.002.pt")


@pytest.mark.parametrize("loader", ["", "torch_dataloader_opts = {'num_workers': 0}"])
def test_returnns_global_config_and_behavior_version_reach_the_frontend(tmp_path, loader):
    """RETURNN's frontend reads ``rf_*`` keys from RETURNN's global config and switches on ``behavior_version``:
    a dropout that asks ``rf.dropout_broadcast_default()`` (as RETURNN's own modules do) trains the same masks
    (drawn after the numbers RETURNN's DataLoader takes from torch's generator: kit.engine.loader_draws, with
    RETURNN's default worker and without), and the step sees the same behavior version, under both tools."""
    src = _demo_rf(tmp_path).read_text()
    edits = {
        "        x = rf.relu(self.layer2(x))\n":
            "        x = rf.relu(self.layer2(x))\n"
            "        x = rf.dropout(x, 0.3, axis=rf.dropout_broadcast_default() and self.layer2.out_dim)\n",
        '    loss.mark_as_loss(name="ce")\n':
            '    loss.mark_as_loss(name="ce")\n'
            '    from returnn.util.basic import BehaviorVersion, is_onnx_export_global\n'
            '    with open(os.environ["RUN_DIR"] + "/seen", "a") as f:\n'
            '        f.write(f"{BehaviorVersion.get()} {rf.dropout_broadcast_default()} {is_onnx_export_global()}\\n")\n',
        "num_epochs = 2": f"num_epochs = 2\nbehavior_version = 21\nrf_dropout_broadcast = False\nonnx_export = True\n{loader}",
    }
    for old, new in edits.items():
        assert old in src, old
        src = src.replace(old, new)
    config = tmp_path / "dropout.config"
    config.write_text(src)
    for runner in ("returnn", "kit"):
        (tmp_path / runner).mkdir()
        args = ["-m", "returnn", str(config)] if runner == "returnn" else ["-m", "kit", "train", str(config)]
        run_python(args, env={"RUN_DIR": str(tmp_path / runner)})
    seen_r, seen_k = ((tmp_path / r / "seen").read_text().splitlines() for r in ("returnn", "kit"))
    assert set(seen_r) == {"21 False True"} and seen_k == seen_r
    steps_r, steps_k = ((tmp_path / r / "steps").read_text().split() for r in ("returnn", "kit"))
    assert len(steps_r) > 10 and steps_k == steps_r
    _same_weights(tmp_path / "returnn" / "model.002.pt", tmp_path / "kit" / "model.002.pt")


def test_rf_module_config_without_returnn_says_what_to_install(tmp_path):
    config = _demo_rf(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(NO_RETURNN)]), RUN_DIR=str(tmp_path))
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "kit", "train", str(config)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kit:")]
    assert len(errors) == 1, proc.stderr
    assert "returnn.frontend.Module" in errors[0] and "pip install returnn" in errors[0]
    assert re.search(r"demo-rf\.config', line \d+", errors[0])
    assert "traceback above" not in proc.stderr and "Traceback" not in proc.stderr


def test_seeding_reaches_returnns_frontend_only_when_loaded():
    from returnn.frontend import rand

    import kit.compat.seeding as seeding

    seeding.seed_returnn_frontend(1234)
    state = rand._step_rnd_seed  # RETURNN's step-based random state, from which rf.Module parameters draw
    seeding.seed_returnn_frontend(1235)
    assert rand._step_rnd_seed != state
    seeding.seed_returnn_frontend(1234)
    assert rand._step_rnd_seed == state


# ---- a batch speaks both APIs, wherever the config imports returnn ----------------------------------


@pytest.mark.parametrize("where", ["top", "inside", "none"])
def test_batch_answers_both_apis_wherever_returnn_is_imported(tmp_path, monkeypatch, where):
    monkeypatch.setenv("IMPORT_AT", where)
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    with kit.Session.from_config(str(FIXTURES / "import_places.config")) as session:
        session.train()
        assert session.scores["train_loss_ce"].iloc[0] == pytest.approx(0.7565496984650107, abs=0)


def test_batch_answers_both_apis_without_returnn(tmp_path):
    """Without RETURNN: a train_step importing returnn inside its body gets the same numbers."""
    run_python(["-m", "kit", "train", str(FIXTURES / "import_places.config")], hide_returnn=True,
               env={"IMPORT_AT": "inside", "RUN_DIR": str(tmp_path)})
    assert _lr_file(tmp_path / "lr")[1]["scores"]["train_loss_ce"] == 0.7565496984650107


def test_kit_field_has_returnns_tensor_names():
    field = kit.Field(torch.zeros(2, 5, 9), torch.tensor([5, 3], dtype=torch.int32))
    assert field.raw_tensor is field.tensor and field.dims is field.dims  # one view, built once
    assert field.dims[1].dyn_size_ext.raw_tensor is field.lengths and field.get_sequence_lengths() is field.lengths
    assert field.dim == 9 and field.feature_dim.dimension == 9 and field.batch_dim.is_batch_dim()
    labels = kit.Field(torch.zeros(2, 5, dtype=torch.int64), field.lengths, sparse_dim=4)
    assert labels.sparse and labels.dim == 4 and labels.sparse_dim == 4  # kit's sparse_dim stays the class count
    static = kit.Field(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        static.get_sequence_lengths()


def test_returnns_tensors_get_kits_names():
    from returnn.tensor import TensorDict

    from kit.compat.bridge import ReturnnBridge

    bridge = ReturnnBridge({"data": {"dim": 9}, "classes": {"dim": 2, "sparse": True}}, None)
    lengths = torch.tensor([5, 3], dtype=torch.int32)
    batch = kit.Batch({"data": kit.Field(torch.rand(2, 5, 9), lengths),
                       "classes": kit.Field(torch.zeros(2, 5, dtype=torch.int32), lengths, sparse_dim=2)},
                      ["seq-0", "seq-1"], [0, 1])
    td = bridge.extern_data(batch, forward=False)
    assert isinstance(td, TensorDict)
    data = td["data"]
    assert data.tensor is data.raw_tensor and data.lengths.tolist() == [5, 3] and data.num_frames() == 8
    assert torch.equal(data.mask(), batch["data"].mask())


# ---- the run directory of a relative config path ------------------------------------------------------


def test_relative_config_path_gives_returnns_run_directory(tmp_path, monkeypatch):
    from returnn.config import Config as ReturnnConfig

    (tmp_path / "setups").mkdir()
    (tmp_path / "setups" / "exp1.config").write_text(textwrap.dedent("""\
        #!rnn.py
        import os
        name, _ = os.path.splitext(__file__)
        model = "runs/" + name + "/model"
        """))
    monkeypatch.chdir(tmp_path)
    theirs = ReturnnConfig()
    theirs.load_file("setups/exp1.config")
    ours = kit.Config.from_file("setups/exp1.config")
    assert ours.typed_value("model") == theirs.value("model", None) == "runs/setups/exp1/model"


# ---- an epoch emptied by the length filter ----------------------------------------------------------


def test_epoch_emptied_by_length_filter_stops_as_in_returnn(tmp_path):
    """RETURNN 1.20261022 stops with an error at the end of a step-less epoch (a ValueError from its padding
    statistics) and writes no checkpoint; kit stops before the epoch with a DataError that says why."""
    import subprocess

    results = {}
    for runner in ("returnn", "kit"):
        run_dir = tmp_path / runner
        run_dir.mkdir()
        args = ["-m", "returnn", SHARED, "++num_epochs", "1"] if runner == "returnn" else \
            ["-m", "kit", "train", SHARED, "num_epochs=1"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), RUN_DIR=str(run_dir), VARIANT="empty_epoch")
        proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=240)
        results[runner] = (proc.returncode, sorted(p.name for p in run_dir.iterdir() if p.name != "model.lock"))
    assert results["returnn"][0] != 0 and results["kit"][0] != 0
    assert results["kit"][1] == results["returnn"][1] == []  # no checkpoint, no score file


# ---- every key RETURNN reads is known ------------------------------------------------------------------


def test_every_key_returnns_torch_path_reads_is_in_kits_table():
    from kit.compat.returnn_keys import missing_returnn_keys, returnn_config_reads

    package = os.path.dirname(returnn.__file__)
    reads = returnn_config_reads(package)
    assert {"batch_size", "batch_size_dev", "batch_size_train", "torch_amp"} <= reads  # the scan finds them
    assert missing_returnn_keys(package) == []


def test_batch_size_dev_and_train_as_in_returnn(caplog):
    from kit.data.pipeline import Pipeline

    data = kit.data.Task12AXDataset(6, seed=1)
    config = kit.Config(batch_size=500, batch_size_dev=50, max_seqs=-1)
    assert Pipeline.from_config(data, config, train=False).batch_size == 50
    assert Pipeline.from_config(data, config, train=True).batch_size == 500
    config = kit.Config(batch_size=500, batch_size_train=70)
    assert Pipeline.from_config(data, config, train=True).batch_size == 70
    with caplog.at_level("WARNING", logger="kit"):
        config = kit.Config(packed_batch_size=100, packed_batch_size_dev=30)
    assert not any("packed_batch_size" in r.getMessage() for r in caplog.records)  # supported now
    assert Pipeline.from_config(data, config, train=False).packed_batch_size == 30
    assert Pipeline.from_config(data, config, train=True).packed_batch_size == 100


def test_old_optimizer_states_deleted_as_returnn_deletes_them(tmp_path):
    """RETURNN's rule: saving epoch N deletes epoch N-2's optimizer state — kit's, and RETURNN's own (RETURNN alone
    would have deleted it); a file under that name that is no optimizer state stays."""
    import torch

    from kit.compat.run_files import delete_old_optimizer_state

    prefix = str(tmp_path / "model")
    opt = {"optimizer": {"state": {}, "param_groups": []}, "param_names": [], "epoch": 1}
    for epoch in (1, 2, 3, 4, 5):
        torch.save({"model": {}, "epoch": epoch}, f"{prefix}.{epoch:03d}.pt")
    torch.save(opt, f"{prefix}.001.opt.pt")  # RETURNN's
    for epoch in (2, 4, 5):  # kit's training states carry kit's mark
        torch.save({**opt, "kit_version": "0.2.0", "progress": {}, "rng": {}}, f"{prefix}.{epoch:03d}.opt.pt")
    Path(f"{prefix}.003.opt.pt").write_bytes(b"not an optimizer state")
    assert delete_old_optimizer_state(prefix, 2) is None  # epoch 0 does not exist
    assert delete_old_optimizer_state(prefix, 3, keep_logic=True) is None  # left to cleanup_old_models
    assert delete_old_optimizer_state(prefix, 3) == f"{prefix}.001.opt.pt"  # RETURNN's own state, by its rule
    assert delete_old_optimizer_state(prefix, 4) == f"{prefix}.002.opt.pt"  # kit's
    assert delete_old_optimizer_state(prefix, 5) is None  # not an optimizer state: stays
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".opt.pt")) == [
        "model.003.opt.pt", "model.004.opt.pt", "model.005.opt.pt"]
