"""extern_data parsing and per-batch validation."""

import numpy as np
import pytest
import torch

from kit.data import ArrayDataset, ExternData, Task12AXDataset, batches
from kit.errors import ConfigError, DataError

SPEC = {"data": {"shape": (None, 9)}, "classes": {"shape": (None,), "sparse_dim": 2}}


def test_parse_forms():
    ed = ExternData(SPEC)
    assert ed["data"].has_time and ed["data"].dtype == np.float32 and ed["data"].shape == (None, 9)
    assert ed["classes"].sparse_dim == 2 and ed["classes"].dtype == np.int64
    short = ExternData(
        {"data": {"dim": 9}, "classes": {"dim": 2, "sparse": True, "available_for_inference": False}}
    )
    assert short["data"] == ed["data"] and short["classes"] == ed["classes"]
    old = ExternData({"data": (9, 2), "classes": (2, 1)})
    assert old["data"] == ed["data"] and old["classes"] == ed["classes"]
    static = ExternData({"speaker": {"shape": (), "dtype": "int32"}, "xvec": {"shape": (3,)}})
    assert not static["speaker"].has_time and not static["xvec"].has_time


def test_bad_specs_list_every_problem():
    with pytest.raises(ConfigError) as err:
        ExternData({"a": {"shap": (None, 3)}, "b": {"shape": (None, None)}, "c": {"dim": 3, "dtype": "nope"}})
    msg = str(err.value)
    assert "'shap'" in msg and "only the first axis" in msg and "unknown dtype" in msg
    with pytest.raises(ConfigError, match="sparse"):
        ExternData({"a": {"sparse": True}})
    with pytest.raises(ConfigError):
        ExternData({})


def one_seq_ds(**seq):
    return ArrayDataset(
        [{"data": np.zeros((4, 9), np.float32), "classes": np.zeros(4, np.int64)}, seq],
        seq_tags=["good", "bad-one"],
    )


@pytest.mark.parametrize(
    "seq,what",
    [
        ({"data": np.zeros((4, 9, 1), np.float32), "classes": np.zeros(4, np.int64)}, "rank"),
        ({"data": np.zeros((4, 8), np.float32), "classes": np.zeros(4, np.int64)}, "axis 1"),
        ({"data": np.zeros((4, 9), np.int64), "classes": np.zeros(4, np.int64)}, "dtype"),
        ({"data": np.zeros((4, 9), np.float32), "classes": np.zeros(4, np.float32)}, "dtype"),
        ({"data": np.zeros((4, 9), np.float32), "classes": np.array([0, 1, 2, 0])}, "out of range"),
        ({"data": np.zeros((4, 9), np.float32), "classes": np.array([0, -1, 0, 0])}, "out of range"),
        ({"data": np.zeros((4, 9), np.float32)}, "missing"),
    ],
)
def test_validation_errors_name_key_expected_received_and_tag(seq, what):
    ds = one_seq_ds(**seq)
    with pytest.raises(DataError) as err:
        list(batches(ds, extern_data=SPEC, batch_size=1000))
    msg = str(err.value)
    assert what in msg and "bad-one" in msg and "expected" in msg
    assert ("'classes'" in msg) or ("'data'" in msg)
    if what != "missing":
        assert "received" in msg


def test_wrong_static_dim_message():
    ds = one_seq_ds(data=np.zeros((4, 8), np.float32), classes=np.zeros(4, np.int64))
    with pytest.raises(DataError, match=r"'data'.*expected 9, received 8"):
        list(batches(ds, extern_data=SPEC))


def test_valid_batches_are_cast_and_carry_sparse_dim():
    ds = ArrayDataset(
        [
            {
                "data": np.zeros((3, 9), np.float64),
                "classes": np.array([0, 1, 1], np.int32),
                "extra": np.ones(2),
            }
        ]
    )
    (b,) = list(batches(ds, extern_data=SPEC))
    assert b["data"].dtype == torch.float32 and b["classes"].dtype == torch.int64
    assert b["classes"].sparse_dim == 2 and b["data"].sparse_dim is None
    assert b["extra"].dtype == torch.float64  # undeclared keys pass through as they are


def test_without_extern_data_everything_is_inferred():
    (b,) = list(batches(ArrayDataset([{"x": np.zeros((2, 5), np.int16), "y": np.array(3.0)}])))
    assert b["x"].dtype == torch.int16 and b["x"].lengths.tolist() == [2]
    assert b["y"].lengths is None


def test_task12ax_passes_its_own_spec():
    ds = Task12AXDataset(30)
    n = sum(b.num_seqs for b in batches(ds, extern_data=ds.extern_data, batch_size=500))
    assert n == 30
