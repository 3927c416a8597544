"""Forward through the real Engine: outputs cut per sequence, the callback protocol,
ForwardResult, longest-first ordering, and the OOM batch split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import TinyModel, tiny_config

import kit
from kit.data import Task12AXDataset
from kit.engine.engine import Engine


def make_engine(**overrides) -> Engine:
    engine = Engine(kit.Config(tiny_config(None, **overrides)))
    engine.setup()
    return engine


def forward_step(*, model, extern_data, **_kwargs):
    """Per-frame logits (with lengths), the same without lengths, and one number per sequence."""
    data = extern_data["data"]
    logits = model(data.tensor)
    ctx = kit.get_run_ctx()
    ctx.mark_as_output(logits, "logits", lengths=data.lengths)
    ctx.mark_as_output(logits.argmax(-1), "labels")  # time axis found from the input's lengths
    ctx.mark_as_output(data.tensor.sum(dim=(1, 2)), "num_frames")  # [B]: no time axis


def dataset(n: int = 13) -> Task12AXDataset:
    return Task12AXDataset(n, seed=5, seq_ordering="random")


def test_outputs_are_cut_to_each_sequence_and_match_the_unpadded_model():
    engine = make_engine(forward_step=forward_step)
    ds = dataset()
    result = engine.forward(ds)
    assert isinstance(result, kit.ForwardResult) and len(result) == len(ds)
    model = engine.model.eval()
    for idx in range(len(ds)):
        out = result[ds.get_seq_tag(idx)]
        length = ds.get_seq_length(idx)["data"]
        assert out["logits"].shape == (length, 2) and out["logits"].dtype == np.float32
        assert out["labels"].shape == (length,)
        assert out["num_frames"].shape == () and out["num_frames"] == length  # one-hot: one per frame
        with torch.no_grad():
            alone = model(torch.from_numpy(ds.get_seq(idx)["data"])[None])[0].numpy()
        np.testing.assert_allclose(out["logits"], alone, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out["labels"], alone.argmax(-1))


class RecordingCallback:
    def __init__(self):
        self.calls = []

    def init(self, *, model, **_kwargs):
        self.calls.append(("init", model))

    def process_seq(self, *, seq_tag, outputs, **_kwargs):
        self.calls.append(("seq", seq_tag, outputs))

    def finish(self, **_kwargs):
        self.calls.append(("finish",))


def test_callback_gets_init_one_call_per_sequence_and_finish():
    engine = make_engine(forward_step=forward_step)
    ds = dataset()
    callback = RecordingCallback()
    assert engine.forward(ds, callback) is None
    kinds = [c[0] for c in callback.calls]
    assert kinds == ["init"] + ["seq"] * len(ds) + ["finish"]
    assert callback.calls[0][1] is engine.model
    tags = [c[1] for c in callback.calls[1:-1]]
    assert sorted(tags) == sorted(ds.get_seq_tag(i) for i in range(len(ds)))
    for _, tag, outputs in callback.calls[1:-1]:
        assert set(outputs) == {"logits", "labels", "num_frames"}
        assert all(isinstance(a, np.ndarray) for a in outputs.values())
        length = ds.get_seq_length(ds.get_seq_index(tag))["data"]
        assert outputs["logits"].shape == (length, 2)  # no batch axis


def test_forward_result_is_a_mapping_in_dataset_order_with_a_dataframe():
    engine = make_engine(forward_step=forward_step)
    ds = dataset(7)
    result = engine.forward(ds)
    tags = [ds.get_seq_tag(i) for i in range(len(ds))]
    assert list(result) == tags and list(result.keys()) == tags and tags[2] in result
    with pytest.raises(KeyError, match="no forward output for seq tag 'nope'"):
        result["nope"]
    df = result.to_pandas()
    assert df.index.name == "seq_tag" and list(df.index) == tags
    assert list(df["num_frames"]) == [ds.get_seq_length(i)["data"] for i in range(len(ds))]
    assert "7 sequences" in repr(result) and "<table>" in result._repr_html_()


def test_forward_runs_longest_first_without_touching_the_users_dataset():
    seen = []

    def recording_step(*, model, extern_data, **kwargs):
        seen.append(extern_data["data"].lengths.tolist())
        forward_step(model=model, extern_data=extern_data, **kwargs)

    engine = make_engine(forward_step=recording_step, max_seqs=3)
    ds = dataset(11)
    order_before = ds.get_seq_order(1)
    engine.forward(ds)
    flat = [n for batch in seen for n in batch]
    assert flat == sorted(flat, reverse=True) and len(seen) > 2
    assert ds.seq_ordering == "random" and ds.get_seq_order(1) == order_before


def _oom_above(limit: int, calls: list[int]):
    def step(*, model, extern_data, **kwargs):
        calls.append(extern_data.num_seqs)
        if extern_data.num_seqs > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        forward_step(model=model, extern_data=extern_data, **kwargs)

    return step


def test_oom_splits_the_batch_and_gives_identical_outputs():
    ds = dataset(13)
    plain = make_engine(forward_step=forward_step).forward(ds)
    calls = []
    split = make_engine(forward_step=_oom_above(2, calls)).forward(ds)
    assert max(calls) > 2 and any(n <= 2 for n in calls)  # it did hit the error and split
    assert list(split) == list(plain)
    for tag in plain:
        for name in ("logits", "labels", "num_frames"):
            np.testing.assert_array_equal(split[tag][name], plain[tag][name])


def test_oom_propagates_when_splitting_is_off():
    engine = make_engine(forward_step=_oom_above(2, []), forward_auto_split_batch_on_oom=False)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="injected"):
        engine.forward(dataset())


def test_oom_on_a_single_sequence_propagates():
    engine = make_engine(forward_step=_oom_above(0, []))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.forward(dataset(3))


def test_model_outputs_are_checked():
    engine = make_engine(forward_step=forward_step, model_outputs={"logits": {"shape": (None, 2)}})
    with pytest.raises(kit.DataError, match="not declared in model_outputs"):
        engine.forward(dataset(3))


def test_forward_restores_train_mode_and_rng():
    engine = make_engine(forward_step=forward_step, get_model=lambda **_: TinyModel(dropout=0.5))
    engine.model.train()
    state = torch.get_rng_state()
    engine.forward(dataset(3))
    assert engine.model.training and torch.equal(torch.get_rng_state(), state)


def test_session_forward_by_seq_tags():
    with kit.Session(tiny_config(None, forward_step=forward_step)) as session:
        result = session.forward(["seq-4", "seq-1"], dataset="dev")
        assert sorted(result) == ["seq-1", "seq-4"]
        with pytest.raises(KeyError, match="seq-999"):
            session.forward(["seq-999"], dataset="dev")
