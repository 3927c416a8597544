"""RETURNN configs run unchanged in kit, with and without RETURNN installed."""

from __future__ import annotations

import logging
import textwrap

import numpy as np
import pytest

import kit
from kit.compat.returnn_keys import RETURNN_KEYS, returnn_keys_markdown
from kit.config.keys import KEYS
from tests.returnn_compat.returnn_helpers import FIXTURES, ROOT, needs_returnn, run_python

DEMO = str(FIXTURES / "demo-torch.config")


def _demo_overrides(tmp_path) -> list[str]:
    small = "{'class': 'Task12AXDataset', 'num_seqs': %d}"
    return [f"model={tmp_path}/model", f"learning_rate_file={tmp_path}/lr", "num_epochs=1",
            "train=" + small % 30, "dev=" + small % 10, "forward_data=" + small % 4]


def _train_and_forward(tmp_path, *, hide_returnn: bool) -> str:
    args = _demo_overrides(tmp_path)
    out = run_python(["-m", "kit", "train", DEMO, *args], hide_returnn=hide_returnn, cwd=tmp_path)
    fwd = run_python(["-m", "kit", "forward", "--output", str(tmp_path / "out.npz"), DEMO, *args],
                     hide_returnn=hide_returnn, cwd=tmp_path)
    assert (tmp_path / "model.001.pt").is_file()
    outputs = np.load(tmp_path / "out.npz", allow_pickle=False)
    assert len(outputs.files) > 0
    return out.stdout + out.stderr + fwd.stdout + fwd.stderr


def _scores(tmp_path) -> dict:
    assert not (tmp_path / "lr.kit.json").exists()  # RETURNN's layout: RETURNN's score file only
    return kit.ScoreTable.load(f"{tmp_path}/lr").scores(1)


def test_demo_config_without_returnn(tmp_path):
    log = _train_and_forward(tmp_path, hide_returnn=True)
    assert log.count("kit's compatibility module") == 2  # once per process (train, forward), not per import
    assert "not supported by kit" not in log  # the demo uses no key kit lacks
    assert set(_scores(tmp_path)) >= {"train_loss_ce", "train_loss_fer", "dev_loss_ce"}
    assert (tmp_path / "lr").read_text().lstrip().startswith("{")  # RETURNN's format, not JSON


@needs_returnn
def test_demo_config_with_returnn_equals_without(tmp_path):
    with_dir, without_dir = tmp_path / "with", tmp_path / "without"
    with_dir.mkdir(), without_dir.mkdir()
    log = _train_and_forward(with_dir, hide_returnn=False)
    assert "compatibility module" not in log
    _train_and_forward(without_dir, hide_returnn=True)
    assert _scores(with_dir) == _scores(without_dir)  # RETURNN's own TensorDict/run context: same numbers


def test_loading_a_config_leaves_no_returnn_stand_in_behind(tmp_path):
    code = textwrap.dedent(f"""
        import sys, kit
        config = kit.Config.from_file({DEMO!r}, model={str(tmp_path / 'm')!r})
        assert not any(m == 'returnn' or m.startswith('returnn.') for m in sys.modules), sorted(sys.modules)
        assert config.typed_value('train_step') is not None
        print('ok')
    """)
    assert run_python(["-c", code], hide_returnn=True).stdout.strip().endswith("ok")


def test_unsupported_returnn_keys_are_named_in_one_warning(tmp_path, caplog):
    path = tmp_path / "c.config"
    path.write_text("forward_batch_size = 10\ncombine_labels = 'x'\nbackend = 'torch'\nbatching = 'sorted'\n"
                    "rf_dropout_broadcast = False\nbehavior_version = 21\n"
                    "train = {'class': 'Task12AXDataset', 'num_seqs': 5}\nmax_seqs = -1\n")
    with caplog.at_level(logging.WARNING, logger="kit"):
        config = kit.Config.from_file(path)
    warnings = [r.getMessage() for r in caplog.records if "not supported by kit" in r.getMessage()]
    assert len(warnings) == 1
    assert "'forward_batch_size'" in warnings[0] and "'combine_labels'" in warnings[0]
    assert "backend" not in warnings[0]  # 'torch': no effect, nothing to warn about
    assert "rf_" not in warnings[0] and "behavior" not in warnings[0]  # handed to RETURNN (kit.compat.global_config)
    assert config.typed_value("train")["seq_ordering"] == "sorted"  # RETURNN's batching
    assert config.typed_value("max_seqs") is None  # RETURNN's -1: no limit
    assert "forward_batch_size" not in config.user_globals  # not silently kept


def test_batching_does_not_override_a_datasets_own_order(tmp_path):
    path = tmp_path / "c.config"
    path.write_text("batching = 'random'\ntrain = {'class': 'Task12AXDataset', 'num_seqs': 5, 'seq_ordering': 'sorted'}\n")
    assert kit.Config.from_file(path).typed_value("train")["seq_ordering"] == "sorted"


def test_extern_data_with_returnn_dims():
    from kit.compat.tensor import Dim, batch_dim

    time, feat, classes = Dim(None, name="time"), Dim(9, name="in"), Dim(2, name="classes")
    config = kit.Config(extern_data={
        "data": {"dims": [batch_dim, time, feat], "dtype": "float32"},
        "classes": {"dims": [batch_dim, time], "sparse_dim": classes, "dtype": "int32", "available_for_inference": False},
    })
    spec = kit.data.ExternData(config.typed_value("extern_data"))
    assert spec["data"].shape == (None, 9) and spec["classes"].sparse_dim == 2
    assert str(spec["classes"].dtype) == "int32"


def test_tensor_view_of_a_batch_field():
    import torch

    from kit.compat.tensor import batch_view

    field = kit.Field(torch.zeros(2, 5, 9), torch.tensor([5, 3], dtype=torch.int32))
    labels = kit.Field(torch.zeros(2, 5, dtype=torch.int64), torch.tensor([5, 3], dtype=torch.int32), sparse_dim=4)
    td = batch_view({"data": field, "classes": labels})
    data = td["data"]
    assert data.raw_tensor is field.tensor and data.dims[1].dyn_size_ext.raw_tensor is field.lengths
    assert data.dims[1].dyn_size is field.lengths and data.dims[2].dimension == 9
    assert data.feature_dim.dimension == 9 and data.dtype == "float32" and data.batch_dim.is_batch_dim()
    assert td["classes"].sparse_dim.dimension == 4 and td["classes"].feature_dim is None
    assert torch.equal(data.mask(), field.mask())


def test_run_ctx_in_returnns_forms():
    import torch

    from kit.compat.run_ctx import get_run_ctx
    from kit.compat.tensor import batch_view
    from kit.run_ctx import RunCtx

    lengths = torch.tensor([3, 1], dtype=torch.int32)
    view = batch_view({"x": kit.Field(torch.ones(2, 3), lengths)})
    with RunCtx("train", train_flag=True, epoch=2, step=7).activate() as ctx:
        rctx = get_run_ctx()
        assert (rctx.stage, rctx.train_flag, rctx.epoch, rctx.step) == ("train_step", True, 2, 7)
        rctx.mark_as_loss(name="ce", loss=view["x"])  # a Tensor view: masked by its lengths
        rctx.mark_as_loss(name="fer", loss=torch.zeros(4), as_error=True)
    assert float(ctx.losses["ce"].sum) == 4.0 and int(ctx.losses["ce"].inv_norm_factor) == 4
    spec = {"output": {"dim": 2}}
    with RunCtx("forward", train_flag=False, epoch=1, step=0, expected_outputs=spec).activate() as ctx:
        rctx = get_run_ctx()
        rctx.expected_outputs["output"].dims[1].dyn_size_ext.raw_tensor = lengths
        rctx.mark_as_default_output(tensor=torch.zeros(2, 3, 2))
    assert ctx.outputs["output"].lengths is lengths


def test_returnn_keys_doc_is_generated_and_fresh():
    doc = (ROOT / "docs" / "returnn_keys.md").read_text(encoding="utf-8")
    assert doc == returnn_keys_markdown(), "docs/returnn_keys.md is stale: run `python -m kit.config.docs`"
    for name, key in RETURNN_KEYS.items():
        assert f"| `{name}` |" in doc
        if key.status == "kit":
            assert name in KEYS, name
        elif name != "max_seqs":  # a kit key, with RETURNN's -1 translated
            assert name not in KEYS, name


@pytest.mark.parametrize("name", ["batching", "context_window", "chunking_variance"])  # torch_profile, torch_batching: kit keys now
def test_returnn_only_keys_are_not_kit_keys(name):
    assert name not in KEYS and name in RETURNN_KEYS


def test_demo_config_through_session_from_config(tmp_path):
    small = {"class": "Task12AXDataset", "num_seqs": 20}
    with kit.Session.from_config(DEMO, model=f"{tmp_path}/model", learning_rate_file=f"{tmp_path}/lr", num_epochs=1,
                                 train=small, dev=dict(small, num_seqs=6, fixed_random_seed=1)) as session:
        session.train()
        assert set(session.scores.columns) >= {"train_loss_ce", "train_loss_fer", "dev_loss_ce"}
        result = session.forward(kit.data.Task12AXDataset(3, seed=5))
        outputs = result.to_pandas()
        assert len(outputs) == 3
