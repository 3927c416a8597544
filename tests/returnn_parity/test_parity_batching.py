"""RETURNN's ``torch_batching`` (a callable batcher) and ``packed_batch_size_train`` / ``_dev`` against the
installed RETURNN on the same run: per-step losses, scores and final weights bitwise, and the batcher sees
the same sequence dicts (keys, dtypes, shapes, values) with the same ``train=`` flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kit.scores import parse_returnn_lr_file
from tests.returnn_compat.returnn_helpers import FIXTURES, needs_returnn, run_python

CONFIG = str(FIXTURES / "shared_run.config")

BATCHER = '''
import torch.utils.data


class AlternateBatching(torch.utils.data.IterableDataset):
    """Batches of up to 3 sequences, alternating between even- and odd-length ones; notes what it sees."""

    def __init__(self, dataset, *, train, **kwargs):
        self.dataset, self.train = dataset, train

    def __iter__(self):
        bins, want = {0: [], 1: []}, 0
        with open(os.path.join(run_dir, "seen"), "a") as f:
            for seq in self.dataset:
                f.write(f"{self.train} " + " ".join(
                    f"{k}:{type(v).__name__}:{v.dtype.str}:{v.shape}:{v.sum() if v.dtype.kind != 'U' else v}"
                    for k, v in sorted(seq.items())) + "\\n")
                bins[seq["data"].shape[0] % 2].append(seq)
                while len(bins[want]) >= 3:
                    yield bins[want][:3]
                    bins[want] = bins[want][3:]
                    want = 1 - want
        for kind in (want, 1 - want):
            for i in range(0, len(bins[kind]), 3):
                yield bins[kind][i:i + 3]


torch_batching = AlternateBatching
'''


def _run(tool: str, run_dir: Path, extra: str, variant: str = "") -> dict:
    run_dir.mkdir()
    config = run_dir / "run.config"
    config.write_text(Path(CONFIG).read_text() + extra + "\nnum_epochs = 2\n")
    env = {"RUN_DIR": str(run_dir), "STEP_LOG": str(run_dir / "steps"), "VARIANT": variant}
    run_python(["-m", "returnn", str(config)] if tool == "returnn" else ["-m", "kit", "train", str(config)], env=env)
    return parse_returnn_lr_file((run_dir / "learning_rates").read_text())["epochs"]


def _same_run(tmp_path: Path, extra: str, variant: str = "") -> str:
    """Both tools train; the same scores, per-step losses and final weights. Returns the step log."""
    want, got = (_run(tool, tmp_path / tool, extra, variant) for tool in ("returnn", "kit"))
    assert {e: r["scores"] for e, r in got.items()} == {e: r["scores"] for e, r in want.items()}  # bitwise
    steps = (tmp_path / "returnn" / "steps").read_text()
    assert (tmp_path / "kit" / "steps").read_text() == steps and steps
    wa, wb = (torch.load(tmp_path / t / "model.002.pt", weights_only=True)["model"] for t in ("returnn", "kit"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return steps


@needs_returnn
def test_a_callable_torch_batching_trains_as_in_returnn(tmp_path):
    _same_run(tmp_path, BATCHER)
    seen = (tmp_path / "returnn" / "seen").read_text()
    assert "True " in seen and "False " in seen  # train and dev, each with RETURNN's flag
    assert (tmp_path / "kit" / "seen").read_text() == seen  # the same dicts, in the same order


@needs_returnn
@pytest.mark.parametrize("keys", [
    "packed_batch_size = 1000\npacked_batch_size_train = 25\npacked_batch_size_dev = 15",
    # a cost no single length bounds (frames times labels), only for training (a function RETURNN can pickle)
    "def cells(lengths):\n    return lengths['data'] * lengths['classes']\n\n\n"
    "packed_batch_size = {'cells': 300, 'data': 1000}\npacked_batch_cost_train = {'cells': cells}",
])
def test_packed_batch_size_per_split_and_packed_batch_cost_as_in_returnn(tmp_path, keys):
    steps = _same_run(tmp_path, "\n" + keys + "\n")
    assert len(steps.splitlines()) > 2 * 24 // 4  # more than max_seqs alone gives: the budget binds


@needs_returnn
def test_a_returnn_pipeline_class_as_torch_batching_trains_as_in_returnn(tmp_path):
    # new dicts with the input's complete_frac / seq_idx in order (kit finds them by their arrays);
    # dynamic_learning_rate reads epoch_continuous, i.e. each batch's complete_frac
    spec = {"class": "BucketOrderingIterDataPipe", "buckets": [(7, 2), (9, 3), (12, 4)], "length_key": "data",
            "monotonic_data_keys": ("complete_frac", "seq_idx")}
    _same_run(tmp_path, f"\ntorch_batching = {spec!r}\n", variant="dynamic_lr")
