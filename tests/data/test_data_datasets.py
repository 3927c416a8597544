"""Built-in datasets and make_dataset."""

import os
import sysconfig

import numpy as np
import pytest
import torch

import kit
from kit.data import (
    ArrayDataset,
    CharTextDataset,
    GeneratorDataset,
    Task12AXDataset,
    TorchDataset,
    make_dataset,
)
from kit.errors import ConfigError, DataError


def gen_fn(seed, index):
    rng = np.random.default_rng([seed, index])
    n = 3 + index % 5
    return {"data": rng.normal(size=(n, 4)).astype(np.float32), "label": np.array(index % 3)}


def test_array_dataset_from_list_and_dict_of_lists():
    a = [np.arange(3), np.arange(5)]
    ds1 = ArrayDataset([{"data": x} for x in a], seq_tags=["a", "b"])
    ds2 = ArrayDataset({"data": a})
    assert len(ds1) == ds1.num_seqs == 2
    assert ds1.get_seq_length(1) == {"data": 5}
    assert ds1.get_seq_tag(1) == "b" and ds2.get_seq_tag(1) == "seq-1"
    assert ds1.get_seq_index("b") == 1
    np.testing.assert_array_equal(ds2.get_seq(1)["data"], np.arange(5))
    with pytest.raises(KeyError, match="'zz'"):
        ds1.get_seq_index("zz")
    with pytest.raises(DataError, match="seq_tags"):
        ArrayDataset([{"data": a[0]}], seq_tags=["x", "y"])
    with pytest.raises(DataError, match="differ"):
        ArrayDataset({"data": a, "other": a[:1]})


def test_generator_dataset_is_deterministic():
    ds = GeneratorDataset(gen_fn, 10, seed=3)
    np.testing.assert_array_equal(
        ds.get_seq(4)["data"], GeneratorDataset(gen_fn, 10, seed=3).get_seq(4)["data"]
    )
    assert not np.array_equal(ds.get_seq(4)["data"], GeneratorDataset(gen_fn, 10, seed=4).get_seq(4)["data"])
    assert ds.get_seq_length(4) == {"data": 7}  # the scalar "label" has no time axis
    with pytest.raises(IndexError):
        ds.get_seq(10)


def test_task12ax_rule_on_hand_made_sequence():
    text = "1AXBY2BYAX1AZX3AX2CBY"
    #       0123456789...
    got = Task12AXDataset.targets(text).tolist()
    expected = [0] * len(text)
    expected[2] = 1  # 1 A X
    expected[7] = 1  # 2 B Y
    expected[13] = 1  # 1 A (Z is a distractor) X
    expected[16] = 1  # '3' does not change the outer context: still 1, A X
    expected[20] = 1  # 2 (C) B Y
    assert got == expected
    assert Task12AXDataset.targets("2AX1BY").tolist() == [0, 0, 0, 0, 0, 0]
    assert Task12AXDataset.targets("1AXX").tolist() == [0, 0, 1, 0]  # X clears the inner context


def test_task12ax_dataset_shapes_and_consistency():
    ds = Task12AXDataset(50, seed=1)
    for i in range(50):
        seq = ds.get_seq(i)
        n = seq["data"].shape[0]
        assert 10 <= n <= 99 and ds.get_seq_length(i) == {"data": n, "classes": n}
        assert seq["data"].dtype == np.float32 and seq["data"].shape == (n, 9)
        assert np.all(seq["data"].sum(axis=1) == 1)
        assert seq["classes"].dtype == np.int64
        text = Task12AXDataset.decode(seq["data"])
        np.testing.assert_array_equal(seq["classes"], Task12AXDataset.targets(text))
    assert sum(int(ds.get_seq(i)["classes"].sum()) for i in range(50)) > 0
    np.testing.assert_array_equal(ds.get_seq(7)["data"], Task12AXDataset(50, seed=1).get_seq(7)["data"])
    assert not np.array_equal(ds.get_seq(7)["classes"], Task12AXDataset(50, seed=2).get_seq(7)["classes"])


def test_char_text_dataset_from_stdlib_without_network():
    assert sysconfig.get_paths()["stdlib"]
    train = CharTextDataset("train", max_files=20)
    dev = CharTextDataset("dev", max_files=20)
    assert len(train) > 100 and len(dev) > 10
    train_files = {train.get_seq_tag(i).split(":")[0] for i in range(len(train))}
    dev_files = {dev.get_seq_tag(i).split(":")[0] for i in range(len(dev))}
    assert not train_files & dev_files
    seq = train.get_seq(3)
    np.testing.assert_array_equal(seq["data"][1:], seq["classes"][:-1])  # target = next char
    assert train.get_seq_length(3)["data"] == len(seq["data"])
    assert seq["data"].max() < len(CharTextDataset.vocab)
    pieces = CharTextDataset("dev", mode="pieces", piece_len=64, max_files=20)
    assert max(pieces.get_seq_length(i)["data"] for i in range(len(pieces))) == 64


class TorchDictDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"data": torch.ones(i + 1, 2), "classes": np.arange(i + 1)}


def test_torch_dataset_adapter():
    ds = TorchDataset(TorchDictDataset())
    assert len(ds) == 4 and isinstance(ds.get_seq(2)["data"], np.ndarray)
    assert ds.get_seq_length(2) == {"data": 3, "classes": 3}
    assert isinstance(make_dataset(TorchDictDataset()), TorchDataset)


def test_make_dataset():
    ds = Task12AXDataset(5)
    assert make_dataset(ds) is ds
    built = make_dataset({"class": "Task12AXDataset", "num_seqs": 7, "seq_ordering": "random"})
    assert isinstance(built, Task12AXDataset) and len(built) == 7
    dotted = make_dataset({"class": "kit.data.toy.Task12AXDataset", "num_seqs": 3})
    assert len(dotted) == 3
    with pytest.raises(ConfigError, match="Task12AXDataset"):
        make_dataset({"class": "Task12AXDatset"})
    with pytest.raises(ConfigError, match="num_seq"):
        make_dataset({"class": "Task12AXDataset", "num_seq": 3})
    with pytest.raises(ConfigError, match="'class'"):
        make_dataset({"num_seqs": 3})
    with pytest.raises(ConfigError, match="cannot import"):
        make_dataset({"class": "no_such_module.Foo"})
    with pytest.raises(DataError):
        make_dataset(42)
    assert kit.data.Dataset is kit.data.dataset.Dataset


def test_char_text_reads_its_sources_with_a_size_cap(tmp_path, monkeypatch):
    import kit.data.text as text

    (tmp_path / "a.py").write_text("x = 1\n" * 10)
    (tmp_path / "b.py").write_text("y = 2\n" * 1000)
    assert CharTextDataset("all", root=str(tmp_path)).num_seqs == 1010
    monkeypatch.setattr(text, "MAX_SOURCE_BYTES", 1000)
    with pytest.raises(kit.DataError, match=r"b\.py is 6000 bytes, more than kit reads \(1000"):
        CharTextDataset("all", root=str(tmp_path))
    os.mkfifo(tmp_path / "c.py")  # a FIFO is refused without being opened (it would block)
    monkeypatch.setattr(text, "MAX_SOURCE_BYTES", 1 << 20)
    with pytest.raises(kit.DataError, match=r"c\.py is a FIFO"):
        CharTextDataset("all", root=str(tmp_path))
