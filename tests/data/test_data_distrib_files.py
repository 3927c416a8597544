"""DistributeFilesDataset: files spread over sub-epochs by size, one sub-dataset at a time, ranks on own files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kit.data import Pipeline, make_dataset
from kit.engine import distributed
from kit.errors import ConfigError

pytest.importorskip("h5py", reason="DistributeFilesDataset over HDF files needs h5py")

from kit.data.distrib_files import DistributeFilesDataset, distribute_by_size  # noqa: E402
from kit.data.hdf import write_hdf  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


def write_files(tmp_path: Path, counts: list[int]) -> list[str]:
    files = []
    for i, n in enumerate(counts):
        rng = np.random.default_rng(i)
        seqs = []
        for _ in range(n):
            t = int(rng.integers(3, 15))
            seqs.append({"data": rng.standard_normal((t, 9)).astype(np.float32), "classes": rng.integers(0, 2, t)})
        write_hdf(tmp_path / f"f{i}.hdf", seqs, [f"f{i}-{j}" for j in range(n)])
        files.append(str(tmp_path / f"f{i}.hdf"))
    return files


def sub_epoch_dataset(files):
    return {"class": "HDFDataset", "files": files, "seq_ordering": "random"}


def test_bins_are_non_empty_runs_of_similar_size():
    assert distribute_by_size([1, 1, 78, 120], 4) == [[0], [1], [2], [3]]
    rng = np.random.default_rng(1)
    for _ in range(50):
        sizes = [int(x) for x in rng.integers(1, 100, size=int(rng.integers(5, 30)))]
        bins = distribute_by_size(sizes, 5)
        assert all(bins) and sum(bins, []) == list(range(len(sizes)))  # non-empty runs, in order
        totals = [sum(sizes[i] for i in b) for b in bins]
        assert max(totals) - min(totals) <= 2 * max(sizes)
    with pytest.raises(ConfigError, match="3 files cannot fill 4"):
        distribute_by_size([1, 2, 3], 4)


def test_sub_epochs_cover_every_file_once_per_full_epoch(tmp_path):
    files = write_files(tmp_path, [4, 6, 3, 5, 2, 7])
    spec = {
        "class": "DistributeFilesDataset",
        "files": files,
        "get_sub_epoch_dataset": sub_epoch_dataset,
        "partition_epoch": 3,
        "seq_ordering": "random",
    }
    ds = make_dataset(spec)
    for full in (0, 1):
        tags = []
        for part in range(3):
            epoch = full * 3 + part + 1
            ds.init_epoch(epoch)
            assert set(ds.sub_dataset.files) == set(ds.files_of_epoch(epoch))  # only this bin's files
            tags += [ds.get_seq_tag(i) for i in ds.get_seq_order(epoch)]
        assert sorted(tags) == sorted(f"f{i}-{j}" for i, n in enumerate([4, 6, 3, 5, 2, 7]) for j in range(n))
    assert ds.files_of_epoch(1) != ds.files_of_epoch(4) or ds.files_of_epoch(2) != ds.files_of_epoch(5)


def test_pipeline_trains_sub_epoch_after_sub_epoch(tmp_path):
    files = write_files(tmp_path, [5, 5, 5, 5])
    ds = DistributeFilesDataset(files=files, get_sub_epoch_dataset=sub_epoch_dataset, partition_epoch=2)
    pipe = Pipeline(ds, batch_size=100)
    seen = []
    for epoch in (1, 2):
        pipe.set_epoch(epoch)
        seen.append({tag for batch in pipe for tag in batch.seq_tags})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 20


def test_bad_options(tmp_path):
    files = write_files(tmp_path, [2, 2])
    with pytest.raises(ConfigError, match="3 files|2 files"):
        DistributeFilesDataset(files=files, get_sub_epoch_dataset=sub_epoch_dataset, partition_epoch=3)
    with pytest.raises(ConfigError, match="'default' or 'random'"):
        DistributeFilesDataset(files=files, get_sub_epoch_dataset=sub_epoch_dataset, seq_ordering="laplace:.2")
    (tmp_path / "list.txt").write_text("# files\n" + "\n".join(files) + "\n")
    assert DistributeFilesDataset(files=str(tmp_path / "list.txt"), get_sub_epoch_dataset=sub_epoch_dataset).files == files


CONFIG = '''
import json, os
import kit
from helpers import models

def get_sub_epoch_dataset(files):
    return {"class": "HDFDataset", "files": files, "seq_ordering": "random"}

def train_step(*, model, extern_data, **kwargs):
    with open(os.environ["KIT_DFD_DUMP"] + "." + os.environ["RANK"], "a") as f:
        f.write(f"{kit.get_run_ctx().epoch} " + " ".join(extern_data.seq_tags) + "\\n")
    models.train_step(model=model, extern_data=extern_data, **kwargs)

train = {"class": "DistributeFilesDataset", "files": json.loads(os.environ["KIT_DFD_FILES"]),
         "get_sub_epoch_dataset": get_sub_epoch_dataset, "partition_epoch": 2, "seq_ordering": "random",
         "distrib_shard_files": True}
extern_data = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 2}}
get_model = models.get_model
batch_size = 60
max_seqs = 3
optimizer = {"class": "sgd"}
learning_rate = 0.01
torch_distributed = {}
num_epochs = 2
'''


@pytest.mark.slow
def test_torchrun_ranks_read_their_own_files(tmp_path, monkeypatch):
    files = write_files(tmp_path, [6, 4, 5, 7, 3, 6, 5, 4])
    (tmp_path / "dfd_config.py").write_text(CONFIG)
    dump = tmp_path / "seen"
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_ENV}
    env.update(
        PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        KIT_DFD_DUMP=str(dump),
        KIT_DFD_FILES=json.dumps(files),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kit"]
    cmd += ["train", str(tmp_path / "dfd_config.py"), f"model={tmp_path / 'run' / 'model'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    rows = {r: [line.split() for line in Path(f"{dump}.{r}").read_text().splitlines()] for r in (0, 1)}
    for epoch in (1, 2):
        own, plans = {}, {}
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "2")
            ds = DistributeFilesDataset(
                files=files,
                get_sub_epoch_dataset=sub_epoch_dataset,
                partition_epoch=2,
                seq_ordering="random",
                distrib_shard_files=True,
            )
            own[rank] = {os.path.basename(f)[:-4] for f in ds.files_of_epoch(epoch)}
            pipe = Pipeline(ds, batch_size=60, max_seqs=3)
            pipe.set_epoch(epoch)
            plans[rank] = [list(b.seq_tags) for b in pipe]
        assert not own[0] & own[1]
        fewest = min(len(plans[0]), len(plans[1]))
        for rank in (0, 1):
            steps = [row[1:] for row in rows[rank] if row[0] == str(epoch)]
            # all of the rank's own batches in its own order, until the first rank runs out
            assert steps == plans[rank][:fewest], rank
            assert {tag.split("-")[0] for batch in steps for tag in batch} <= own[rank]
