"""``shuffle_frames_of_nseqs`` in a training run against the installed RETURNN: the same per-step losses.

RETURNN's HDFDataset with its cache on (where RETURNN 1.20261022 shuffles frames), a train dataset
from the config key, a per-sequence loss that depends on which frames a sequence holds; the default
order, so RETURNN's first-epoch frames are also those of its second epoch (kit shuffles every epoch by
its own groups: the same here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("h5py", reason="HDF parity needs h5py")

from kit.data.hdf import write_hdf  # noqa: E402
from tests.returnn_compat.returnn_helpers import needs_returnn, run_python  # noqa: E402

CONFIG = r'''#!rnn.py
# RUN_DIR, STEP_LOG, HDF (the train file) and NSEQS (shuffle_frames_of_nseqs) come from the environment
import os
import sys
import numpy
import torch
import returnn.frontend as rf
from returnn.tensor import TensorDict

run_dir = os.environ["RUN_DIR"]
step_log = os.environ.get("STEP_LOG")
backend = "torch"
task = "train"
device = "cpu"
random_seed = 7
train = {"class": "HDFDataset", "files": [os.environ["HDF"]], "cache_byte_size": 10**8}
if "kit.engine" not in sys.modules:
    # RETURNN's CachedDataset preloads (and shuffles) on a thread that marks sequences loaded before it shuffles
    # them: under load the first batch may get the file's frames. Its preload runs in place here, so RETURNN gives
    # what its code means to give, every run (kit has no such thread).
    import returnn.datasets.cached as _cached

    class _InPlace:
        def __init__(self, target, args=(), daemon=None):
            self.target, self.args = target, args

        def start(self):
            self.target(*self.args)

    _cached.threading = type("threading", (), {"Thread": _InPlace})
shuffle_frames_of_nseqs = int(os.environ.get("NSEQS", "3"))
extern_data = {"data": {"dim": 3}}
batch_size = 100
max_seqs = 1
torch_dataloader_opts = {"num_workers": 0}
optimizer = {"class": "adam"}
learning_rate = 0.01
learning_rate_file = os.path.join(run_dir, "learning_rates")
model = os.path.join(run_dir, "model")
num_epochs = 2
log_verbosity = 2


def get_model(*, epoch, step, **_kwargs):
    return torch.nn.Linear(3, 1)


def train_step(*, model, extern_data: TensorDict, **_kwargs):
    data = extern_data["data"]
    x = data.raw_tensor
    # a per-sequence loss that depends on which frames a sequence holds and in which order
    pred = model(x[:, :-1])[..., 0]
    loss = ((pred - x[:, 1:, 0]) ** 2).sum() + 0.0 * x.sum()
    ctx = rf.get_run_ctx()
    ctx.mark_as_loss(name="mse", loss=loss)
    if step_log and ctx.train_flag:
        with open(step_log, "a") as f:
            f.write(f"{ctx.epoch} {float(loss)!r}\n")
'''


def _steps(tool: str, run_dir: Path, hdf: Path, nseqs: int) -> str:
    run_dir.mkdir()
    (run_dir / "run.config").write_text(CONFIG)
    env = {"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps"), "HDF": str(hdf), "NSEQS": str(nseqs)}
    args = ["-m", "returnn"] if tool == "returnn" else ["-m", "kit", "train"]
    run_python([*args, str(run_dir / "run.config")], env=env)
    return (run_dir / "steps").read_text()


@needs_returnn
def test_training_losses_equal_returnn(tmp_path):
    hdf = tmp_path / "frames.hdf"
    rng = np.random.RandomState(7)
    write_hdf(hdf, [{"data": rng.uniform(-1, 1, (n, 3)).astype("float32")} for n in [3, 5, 2, 4, 6, 3, 7, 1, 4, 5, 2, 6]])
    want = _steps("returnn", tmp_path / "returnn", hdf, 3)
    assert len(want.splitlines()) == 24  # 12 sequences, one per step, 2 epochs
    assert _steps("kit", tmp_path / "kit", hdf, 3) == want  # bitwise
    assert _steps("kit", tmp_path / "plain", hdf, 0) != want  # negative control: unshuffled frames train otherwise
