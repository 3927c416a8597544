"""Training on several processes (kit/engine/distributed.py).

Two CPU ranks (gloo) run under ``torchrun --standalone`` (it picks a free port itself) on
tests/helpers/ddp_config.py; each rank dumps its weights, the batches it trained on, the
files it wrote and its log at exit. A single process with ``accum_grad_multiple_step=2``
and half the learning rate on the same 12 batches is the reference: DDP averages the two
ranks' gradients, so each update must be the same up to float rounding. The remaining
checks run in this process with a world of one.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.models import tiny_config

from kit.checkpoints import list_checkpoints
from kit.config import Config
from kit.data import Task12AXDataset, batches
from kit.engine import distributed
from kit.engine.engine import Engine
from kit.errors import ConfigError
from kit.scores import ScoreTable

TESTS = Path(__file__).resolve().parent
CONFIG = TESTS / "helpers" / "ddp_config.py"
LR = 0.002  # ddp_config's learning rate
BATCHES, STEPS = 13, 6  # per epoch: planned batches, steps of each of the 2 ranks (floor(13 / 2))


class _First12Batches(Task12AXDataset):
    """ddp_config's train data without the 13th batch (the one the two ranks leave out)."""

    def get_seq_order(self, epoch: int, **kwargs):
        return super().get_seq_order(epoch, **kwargs)[:120]


def _planned_batches(epoch: int) -> list[list[str]]:
    """The sequence tags of each train batch a single process plans for ``epoch``."""
    data = Task12AXDataset(130, seed=1, seq_ordering="random")
    return [b.seq_tags for b in batches(data, epoch=epoch, batch_size=1000, max_seqs=10)]


def _torchrun(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """``torchrun --nproc-per-node 2 -m kit train ddp_config.py OVERRIDES``; each rank's dump."""
    dump = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_ENV}
    env.update(
        PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        KIT_DDP_DUMP=str(dump),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "kit",
        "train",
        str(CONFIG),
        f"model={tmp_path / 'run' / 'model'}",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    return [torch.load(f"{dump}.rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """One process, 2 epochs, accumulating the 2 batches the ranks train on side by side, lr / 2."""
    prefix = tmp_path_factory.mktemp("reference") / "model"
    config = Config.from_file(
        CONFIG,
        model=str(prefix),
        num_epochs=2,
        accum_grad_multiple_step=2,
        learning_rate=LR / 2,
        train=_First12Batches(130, seed=1, seq_ordering="random"),
    )
    engine = Engine(config)
    engine.train()
    engine.close()
    return engine


def _epoch_weights(prefix: Path, epoch: int) -> dict[str, torch.Tensor]:
    (ckpt,) = [c for c in list_checkpoints(str(prefix)) if c.kind == "epoch" and c.epoch == epoch]
    return torch.load(ckpt.path, weights_only=True)["model"]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def _assert_same_weights(dumps: list[dict]) -> None:
    a, b = dumps[0]["state"], dumps[1]["state"]
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), "the ranks ended with different weights"


def _assert_epoch_shares(dumps: list[dict], epoch: int) -> None:
    """Rank r trained on batches r, r + 2, ... of the epoch's plan; nobody on the 13th."""
    planned = _planned_batches(epoch)
    assert len(planned) == BATCHES
    for rank, dump in enumerate(dumps):
        assert dump["seen"][epoch] == planned[: 2 * STEPS][rank::2]


def test_ddp_two_ranks_train_resume_and_match_one_process(tmp_path: Path, reference: Engine) -> None:
    dumps = _torchrun(tmp_path, "epoch1", "num_epochs=1", "torch_distributed={}")
    assert [sorted(d["seen"]) for d in dumps] == [[1], [1]]
    _assert_epoch_shares(dumps, 1)
    assert {t for d in dumps for t in d["model_types"]} == {"TinyModel"}  # the user's module, not DDP
    _assert_same_weights(dumps)
    # rank 0 alone writes files and logs at INFO
    assert dumps[1]["written"] == []
    assert any(p.endswith("model.001.pt") for p in dumps[0]["written"])
    assert any(p.endswith("model.scores.json") for p in dumps[0]["written"])
    assert any(m.startswith("INFO: start epoch 1") for m in dumps[0]["logs"])
    assert not [m for m in dumps[1]["logs"] if m.startswith("INFO")]
    scores = ScoreTable.load(tmp_path / "run" / "model.scores.json")
    assert scores.epochs == [1]
    assert scores.meta(1)["epoch_num_train_steps"] == 2 * STEPS
    assert _close(dumps[0]["state"], _epoch_weights(reference.model_prefix, 1))

    # a second run with more epochs continues from epoch 1's checkpoint on both ranks
    dumps = _torchrun(tmp_path, "epoch2", "num_epochs=2", "torch_distributed={}")
    assert [sorted(d["seen"]) for d in dumps] == [[2], [2]]
    _assert_epoch_shares(dumps, 2)
    _assert_same_weights(dumps)
    assert any("starting from" in m and "model.001.pt" in m for m in dumps[0]["logs"])
    assert dumps[1]["written"] == []
    scores = ScoreTable.load(tmp_path / "run" / "model.scores.json")
    assert scores.epochs == [1, 2]
    assert _close(dumps[0]["state"], _epoch_weights(reference.model_prefix, 2))
    for epoch in (1, 2):  # global scores: Σ sums / Σ norms over both ranks' shares
        ours, ref = scores.scores(epoch), reference.scores.scores(epoch)
        assert ours.keys() == ref.keys() == {"train_loss_ce", "train_loss_fer", "dev_loss_ce", "dev_loss_fer"}
        assert all(ours[k] == pytest.approx(ref[k], rel=1e-4) for k in ours), (ours, ref)


def test_reference_comparison_can_fail(tmp_path: Path, reference: Engine) -> None:
    """Negative control: summing instead of averaging the ranks' gradients (lr not halved) differs."""
    config = Config.from_file(
        CONFIG,
        model=str(tmp_path / "model"),
        num_epochs=1,
        accum_grad_multiple_step=2,
        learning_rate=LR,
        train=_First12Batches(130, seed=1, seq_ordering="random"),
    )
    engine = Engine(config)
    engine.train()
    assert not _close(engine.model.state_dict(), _epoch_weights(reference.model_prefix, 1))
    engine.close()


def test_param_averaging_two_ranks(tmp_path: Path, reference: Engine) -> None:
    """reduce_type "param", averaging after every update: with SGD the same updates as DDP's."""
    dumps = _torchrun(
        tmp_path, "param", "num_epochs=1", "torch_distributed={'reduce_type': 'param', 'param_sync_step': 1}"
    )
    _assert_epoch_shares(dumps, 1)
    _assert_same_weights(dumps)
    assert dumps[1]["written"] == []
    assert ScoreTable.load(tmp_path / "run" / "model.scores.json").epochs == [1]
    assert _close(dumps[0]["state"], _epoch_weights(reference.model_prefix, 1))


# ---- in this process ---------------------------------------------------------------------------


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch):
    """torchrun's environment for one process (MASTER_PORT=0: the OS picks a free port)."""
    assert not dist.is_initialized()
    for name, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    ).items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():  # a failed test must not leave its group to the next one
        dist.destroy_process_group()


def test_torch_distributed_without_torchrun_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    for name in distributed.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    engine = Engine(Config(tiny_config(str(tmp_path / "model"), torch_distributed={})))
    with pytest.raises(
        ConfigError,
        match=r"'torch_distributed' is set, but this process was not started by "
        r"torchrun .*torchrun --nproc_per_node N -m kit train CONFIG",
    ):
        engine.train()
    assert not dist.is_initialized()
    assert not list(tmp_path.iterdir())


def test_bad_options_are_listed_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        distributed.parse_options({"reduce_typ": "grad", "reduce_type": "param"})
    assert len(info.value.problems) == 2
    assert "unknown option 'reduce_typ' — did you mean 'reduce_type'?" in str(info.value)
    assert "reduce_type 'param' needs param_sync_step" in str(info.value)
    with pytest.raises(ConfigError, match="expected a dict"):
        distributed.parse_options(True)
    assert distributed.parse_options({}) == ("grad", None, {}, None)


def test_torchrun_without_the_key_warns_on_other_ranks(monkeypatch, caplog) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="kit"):
        assert distributed.from_config(Config(tiny_config()), torch.device("cpu")) is None
    assert "rank 1 of 2" in caplog.text and "duplicating rank 0's work" in caplog.text
    assert not dist.is_initialized()


def test_shares_of_an_epoch() -> None:
    items = list(range(7))
    assert [distributed.shard(items, r, 2, drop_remainder=True) for r in (0, 1)] == [[0, 2, 4], [1, 3, 5]]
    assert [distributed.shard(items, r, 2, drop_remainder=False) for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5]]
    assert [distributed.shard(items, r, 3, drop_remainder=True) for r in (0, 1, 2)] == [
        [0, 3],
        [1, 4],
        [2, 5],
    ]


def test_world_of_one_ddp_equals_one_process_and_syncs_once_per_window(
    tmp_path, world_of_one, monkeypatch
) -> None:
    """accum_grad_multiple_step=3 over 19 steps: 7 updates, 7 gradient all-reduces (no_sync in between)."""
    reduces = []

    def count(state, bucket):
        reduces.append(1)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    prepare = distributed.DistributedContext.prepare_model

    def prepare_and_count(self, model):
        prepare(self, model)
        self.ddp.register_comm_hook(None, count)

    monkeypatch.setattr(distributed.DistributedContext, "prepare_model", prepare_and_count)
    keys = dict(num_epochs=1, accum_grad_multiple_step=3)
    ddp = Engine(Config(tiny_config(str(tmp_path / "ddp" / "model"), torch_distributed={}, **keys)))
    ddp.train()
    assert ddp.progress.num_updates == 7 and len(reduces) == 7
    plain = Engine(Config(tiny_config(str(tmp_path / "plain" / "model"), **keys)))
    plain.train()
    for name, value in plain.model.state_dict().items():
        assert torch.equal(ddp.model.state_dict()[name], value), name
    assert ddp.scores.scores(1) == plain.scores.scores(1)
    ddp.close()
    plain.close()
    assert not dist.is_initialized()  # Engine.close() destroyed the group it created
    if sys.platform == "linux":  # and its gloo threads are gone: left to the exit, they can abort it
        threads = [
            (Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")
        ]
        assert not [t for t in threads if "gloo" in t], threads


def test_param_sync_every_n_updates_and_at_epoch_end(tmp_path, world_of_one, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(distributed, "average_parameters", lambda model, world_size: calls.append(world_size))
    engine = Engine(
        Config(
            tiny_config(
                str(tmp_path / "model"),
                num_epochs=2,
                torch_distributed={"reduce_type": "param", "param_sync_step": 5},
            )
        )
    )
    engine.train()
    # 19 updates per epoch, counted globally: after updates 5, 10, 15 | 20, 25, 30, 35; plus each epoch end
    assert engine.progress.num_updates == 38
    assert len(calls) == 3 + 1 + 4 + 1
    engine.close()
