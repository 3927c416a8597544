"""RETURNN's ``window`` (a Dataset default from the config) against the installed RETURNN: the same
training run (per-step losses, scores, final weights bitwise) and, for a RETURNN class kit runs through
its adapter, the same windowed features."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kit.scores import parse_returnn_lr_file
from tests.returnn_compat.returnn_helpers import FIXTURES, needs_returnn, run_python

CONFIG = str(FIXTURES / "shared_run.config")

# 12AX sequences for both tools (kit's Task12AXDataset, RETURNN's own), a window of 3 over the 9 inputs
WINDOW = '''
train = {"class": "Task12AXDataset", "num_seqs": 10}
dev = {"class": "Task12AXDataset", "num_seqs": 4, "fixed_random_seed": 5}
window = 3
extern_data = {"data": {"dim": 27}, "classes": {"dim": 2, "sparse": True}}
batch_size = 200


def get_model(*, epoch, step, **_kwargs):
    return torch.nn.Linear(27, 2)
'''


def _run(tool: str, run_dir: Path) -> dict:
    run_dir.mkdir()
    config = run_dir / "run.config"
    config.write_text(Path(CONFIG).read_text() + WINDOW + "\nnum_epochs = 2\n")
    env = {"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps")}
    run_python(["-m", "returnn", str(config)] if tool == "returnn" else ["-m", "kit", "train", str(config)], env=env)
    return parse_returnn_lr_file((run_dir / "learning_rates").read_text())["epochs"]


@needs_returnn
def test_a_window_of_3_trains_as_in_returnn(tmp_path):
    want, got = (_run(tool, tmp_path / tool) for tool in ("returnn", "kit"))
    assert {e: r["scores"] for e, r in got.items()} == {e: r["scores"] for e, r in want.items()}  # bitwise
    steps = (tmp_path / "returnn" / "steps").read_text()
    assert (tmp_path / "kit" / "steps").read_text() == steps and steps
    wa, wb = (torch.load(tmp_path / t / "model.002.pt", weights_only=True)["model"] for t in ("returnn", "kit"))
    assert wa["weight"].shape == (2, 27)  # the model saw 27-dim input in both
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@needs_returnn
def test_the_config_window_reaches_returnn_classes_through_the_adapter():
    from returnn.datasets.generating import DummyDataset

    from kit.config import Config
    from kit.engine.parts import build_datasets

    spec = {"class": "DummyDataset", "input_dim": 4, "output_dim": 3, "num_seqs": 3, "seq_len": 5}
    kit_ds = build_datasets(Config({"train": spec, "window": 3}))["train"]
    kit_ds.init_epoch(1)
    ref = DummyDataset(input_dim=4, output_dim=3, num_seqs=3, seq_len=5, window=3)
    ref.initialize()
    ref.init_seq_order(epoch=1)
    ref.load_seqs(0, 3)
    for i in range(3):
        got = kit_ds.get_seq(i)["data"]
        assert got.shape == (5, 12) and np.array_equal(got, ref.get_data(i, "data"))
    plain = build_datasets(Config({"train": spec}))["train"]  # negative control: no window, 4 features
    plain.init_epoch(1)
    assert plain.get_seq(0)["data"].shape == (5, 4)


@needs_returnn
def test_hdf_window_equals_returnn(tmp_path):
    from returnn.datasets.hdf import HDFDataset as ReturnnHDF

    from kit.data.hdf import write_hdf

    rng = np.random.RandomState(3)
    seqs = [{"data": rng.uniform(-1, 1, (n, 4)).astype("float32"), "classes": rng.randint(0, 3, n).astype("int32")}
            for n in (5, 1, 7)]
    path = str(tmp_path / "w.hdf")
    write_hdf(path, seqs)
    kit_ds = build_datasets_for({"class": "HDFDataset", "files": [path]}, window=5)
    ref = ReturnnHDF(files=[path], window=5, cache_byte_size=0)
    ref.initialize()
    ref.init_seq_order(epoch=1)
    ref.load_seqs(0, 3)
    assert ref.get_data_dim("data") == 20 and kit_ds.extern_data["data"]["shape"] == (None, 20)
    for i in range(3):
        got = kit_ds.get_seq(i)
        assert got["data"].shape[1] == 20 and np.array_equal(got["data"], ref.get_data(i, "data"))
        assert np.array_equal(got["classes"], ref.get_data(i, "classes"))


def build_datasets_for(spec: dict, **keys) -> object:
    from kit.config import Config
    from kit.engine.parts import build_datasets

    ds = build_datasets(Config({"train": spec, **keys}))["train"]
    ds.init_epoch(1)
    return ds
