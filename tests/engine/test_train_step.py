"""One train step of the real Engine: loss accounting, gradients, accumulation, counters,
the non-finite guard, learning-rate control through training, and host-sync counts.

Hand computations run the same model on the same batches (``kit.data.batches`` with the
config's batching keys), so each test compares the engine with plain PyTorch.
"""

from __future__ import annotations

import contextlib
import copy
import math
import traceback

import pytest
import torch
from helpers.models import TinyModel, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

import kit
from kit.data import Task12AXDataset, batches
from kit.engine.engine import Engine

BATCHING = dict(batch_size=600, max_seqs=10)  # as in tiny_config


def no_dropout_model(*, epoch, step, **_kwargs):
    return TinyModel(dropout=0.0)


def make_engine(**overrides) -> Engine:
    overrides.setdefault("get_model", no_dropout_model)
    return Engine(kit.Config(tiny_config(None, **overrides)))


def train_batches(cfg_overrides: dict | None = None, epoch: int = 1) -> list[kit.Batch]:
    cfg = tiny_config(None, **(cfg_overrides or {}))
    return list(batches(cfg["train"], epoch=epoch, extern_data=cfg["extern_data"], **BATCHING))


def masked_ce(model: torch.nn.Module, batch: kit.Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ masked frame CE, number of real frames) — what the engine should account for a step."""
    logits = model(batch["data"].tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["classes"].tensor, reduction="none")
    mask = batch["classes"].mask()
    return torch.where(mask, ce, 0).sum(), mask.sum()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def tensors_equal(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---- loss accounting ----------------------------------------------------------------------


def test_epoch_scores_are_frame_weighted_sums_over_norms():
    # learning rate 0: the weights stay the initial ones, so the hand computation can use them;
    # sorted order: batches of very different frame counts, where a plain mean of step means is wrong
    data = {"train": Task12AXDataset(120, seed=1, seq_ordering="sorted")}
    engine = make_engine(learning_rate=0.0, **data)
    engine.setup()
    model0 = copy.deepcopy(engine.model)
    step_values = []
    engine.events.on("step_end", lambda result: step_values.append(result.losses))
    row = engine.train_epoch()

    sums, norms, per_step = 0.0, 0, []
    with torch.no_grad():
        for batch in train_batches(data):
            s, n = masked_ce(model0, batch)
            sums, norms = sums + float(s), norms + int(n)
            per_step.append(float(s) / int(n))
    assert len(step_values) == len(per_step) > 3
    assert [v["ce"] for v in step_values] == pytest.approx(per_step, rel=1e-6)
    assert row["train_loss_ce"] == pytest.approx(sums / norms, rel=1e-6)
    # negative control: the plain mean of step means would fail the comparison above
    assert sum(per_step) / len(per_step) != pytest.approx(sums / norms, rel=1e-6)

    dev = tiny_config(None)["dev"]
    dsum, dnorm, errs = 0.0, 0, 0.0
    with torch.no_grad():
        for batch in batches(dev, train=False, extern_data=dev.extern_data, **BATCHING):
            s, n = masked_ce(model0, batch)
            logits = model0(batch["data"].tensor)
            wrong = (logits.argmax(-1) != batch["classes"].tensor) & batch["classes"].mask()
            dsum, dnorm, errs = dsum + float(s), dnorm + int(n), errs + float(wrong.sum())
    assert row["dev_loss_ce"] == pytest.approx(dsum / dnorm, rel=1e-6)
    assert row["dev_loss_fer"] == pytest.approx(errs / dnorm, rel=1e-9)


def test_custom_inv_norm_factor_weights_the_epoch_score():
    # per-sequence loss normalized by the number of sequences: Σ sums / Σ num_seqs
    def train_step(*, model, extern_data, **_kwargs):
        s, _ = masked_ce(model, extern_data)
        seqs = torch.full((), extern_data.num_seqs)
        kit.get_run_ctx().mark_as_loss(s, "ce_seq", custom_inv_norm_factor=seqs)

    engine = make_engine(learning_rate=0.0, train_step=train_step, dev=None)
    engine.setup()
    model0 = copy.deepcopy(engine.model)
    row = engine.train_epoch()
    with torch.no_grad():
        total = sum(float(masked_ce(model0, b)[0]) for b in train_batches())
    assert row["train_loss_ce_seq"] == pytest.approx(total / 120, rel=1e-6)


def test_epoch_scores_when_the_marked_losses_change_between_steps():
    # "odd" is marked on odd steps only, and in a different order: each name sums its own steps
    def train_step(*, model, extern_data, **_kwargs):
        s, n = masked_ce(model, extern_data)
        ctx = kit.get_run_ctx()
        if ctx.step % 2:
            ctx.mark_as_loss(s * 2, "odd", custom_inv_norm_factor=n)
        ctx.mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    engine = make_engine(learning_rate=0.0, train_step=train_step, dev=None)
    engine.setup()
    model0 = copy.deepcopy(engine.model)
    for _ in range(5):
        engine.train_step()
    engine.capture()  # a mid-epoch read (step checkpoint) in between
    row = engine.train_epoch()
    with torch.no_grad():
        per_step = [masked_ce(model0, b) for b in train_batches()]
    ce = sum(float(s) for s, _ in per_step) / sum(int(n) for _, n in per_step)
    odd = per_step[1::2]
    odd_value = sum(2 * float(s) for s, _ in odd) / sum(int(n) for _, n in odd)
    assert row["train_loss_ce"] == pytest.approx(ce, rel=1e-6)
    assert row["train_loss_odd"] == pytest.approx(odd_value, rel=1e-6)
    assert engine.scores.meta(1)["epoch_num_train_steps"] == len(per_step)


# ---- gradients: scale, as_error, use_normalized_loss --------------------------------------


def _scaled_step(*, scale: float, normalized: bool):
    def train_step(*, model, extern_data, **_kwargs):
        logits = model(extern_data["data"].tensor)
        classes = extern_data["classes"]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
        ctx = kit.get_run_ctx()
        ctx.mark_as_loss(ce, "ce", mask=classes.mask(), scale=scale, use_normalized_loss=normalized)
        # an error loss with a huge value: it must not touch the gradient
        ctx.mark_as_loss(logits.sum(-1) * 1e6, "big_error", mask=classes.mask(), as_error=True)

    return train_step


def test_read_losses_divide_as_torch_does_also_by_a_zero_norm():
    """The history's CPU read (scalar by scalar in Python floats) gives torch's float64 quotients,
    0 / 0 and x / 0 included (a Python float division would raise there)."""
    from kit.engine.accounting import StepLosses, read_normalized

    pairs = [(torch.tensor(1.0), torch.tensor(3)), (torch.tensor(0.1, dtype=torch.float64), torch.tensor(7.0)),
             (torch.tensor(0.0), torch.tensor(0)), (torch.tensor(-2.0), torch.tensor(0)),
             (torch.tensor(float("nan")), torch.tensor(0))]
    steps = [StepLosses(["ce"], [s], [n]) for s, n in pairs]
    expected = [float(s.double() / n.double()) for s, n in pairs]
    read = [row["ce"] for row in read_normalized(steps)]
    same = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(read, expected)]
    assert same == [True] * 5 and len(read) == 5
    assert read[:2] == [1.0 / 3.0, 0.1 / 7.0] and read[3] == -math.inf and math.isnan(read[2]) and math.isnan(read[4])


@pytest.mark.parametrize("normalized", [False, True], ids=["sum", "normalized"])
def test_gradient_is_scale_times_sum_or_normalized(normalized):
    engine = make_engine(
        train_step=_scaled_step(scale=0.3, normalized=normalized),
        optimizer={"class": "sgd"},
        learning_rate=0.1,
    )
    engine.setup()
    model0 = copy.deepcopy(engine.model)
    result = engine.train_step()
    assert set(result.losses) == {"ce", "big_error"}
    # the engine keeps the gradients of the last window until the next one starts
    got = grads(engine.model)

    batch = train_batches()[0]
    s, n = masked_ce(model0, batch)
    (0.3 * (s / n if normalized else s)).backward()
    want = grads(model0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    # negative control: the other convention gives a clearly different gradient
    ratio = float(n) if normalized else 1 / float(n)
    assert not torch.allclose(got["inp.weight"], want["inp.weight"] * ratio, rtol=1e-3)


# ---- gradient accumulation and counters -----------------------------------------------------


def test_accumulation_sums_gradients_of_micro_batches_into_one_update():
    lr = 0.5
    engine = make_engine(accum_grad_multiple_step=2, optimizer={"class": "sgd"}, learning_rate=lr)
    engine.setup()
    model0 = copy.deepcopy(engine.model)
    first = engine.train_step()
    assert not first.updated and engine.progress.num_updates == 0
    assert tensors_equal(params(engine.model), params(model0))  # no update after one micro-batch
    second = engine.train_step()
    assert second.updated
    assert (engine.progress.global_train_step, engine.progress.num_updates) == (2, 1)

    def manual(divide: bool) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(model0)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        opt.zero_grad()
        for batch in train_batches()[:2]:
            s, _ = masked_ce(model, batch)
            (s / 2 if divide else s).backward()
        opt.step()
        return params(model)

    summed, averaged = manual(divide=False), manual(divide=True)
    got = params(engine.model)
    for name in got:
        torch.testing.assert_close(got[name], summed[name], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(got["inp.weight"], averaged["inp.weight"], rtol=1e-4)


def test_accumulation_callable_gets_its_arguments_and_sets_the_window():
    calls = []

    def accum(*, epoch, epoch_continuous, global_train_step, **kwargs):
        calls.append((epoch, epoch_continuous, global_train_step))
        return 3 if epoch == 1 else 1

    engine = make_engine(accum_grad_multiple_step=accum, num_epochs=2)
    updates = []
    engine.events.on("step_end", lambda result: updates.append((result.epoch, result.updated)))
    engine.train()
    steps_ep1 = sum(1 for e, _ in updates if e == 1)
    steps_ep2 = len(updates) - steps_ep1
    assert [g for _, _, g in calls] == list(range(steps_ep1 + steps_ep2))  # once per micro-batch
    assert [e for e, _, _ in calls] == [1] * steps_ep1 + [2] * steps_ep2
    frac = [c for _, c, _ in calls]
    assert frac == sorted(frac) and 0 < frac[0] < 1 and frac[steps_ep1 - 1] == pytest.approx(1.0)
    assert frac[-1] == pytest.approx(2.0)
    # epoch 1: an update every 3rd micro-batch; a partial window at the epoch end is applied too
    assert [u for e, u in updates if e == 1] == [(i + 1) % 3 == 0 for i in range(steps_ep1)]
    assert all(u for e, u in updates if e == 2)
    assert engine.progress.global_train_step == steps_ep1 + steps_ep2
    assert engine.progress.num_updates == math.ceil(steps_ep1 / 3) + steps_ep2


def test_accumulation_callable_without_kwargs_is_a_config_error():
    engine = make_engine(accum_grad_multiple_step=lambda *, epoch, epoch_continuous, global_train_step: 2)
    with pytest.raises(kit.ConfigError, match=r"accum_grad_multiple_step.*\*\*kwargs"):
        engine.train_step()


# ---- the non-finite guard --------------------------------------------------------------------


def _optimizer_snapshot(engine: Engine) -> dict:
    return copy.deepcopy(engine.optimizer.state_dict())


def test_nan_loss_raises_before_the_update_and_leaves_weights_and_optimizer_untouched():
    k = 3

    def train_step(*, model, extern_data, **_kwargs):
        s, n = masked_ce(model, extern_data)
        ctx = kit.get_run_ctx()
        if ctx.step == k:
            s = s * float("nan")
        ctx.mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    engine = make_engine(train_step=train_step)  # Adam: its state changes with every update
    for _ in range(k):
        engine.train_step()
    before_params, before_opt = params(engine.model), _optimizer_snapshot(engine)
    assert before_opt["state"], "Adam has state after k updates"
    with pytest.raises(kit.NonFiniteLossError) as info:
        engine.train_step()
    msg = str(info.value)
    assert "epoch 1" in msg and f"step {k}" in msg and "loss ce" in msg
    assert (info.value.epoch, info.value.step) == (1, k)
    assert tensors_equal(params(engine.model), before_params)
    assert tensors_equal(_optimizer_snapshot(engine), before_opt)
    assert engine.progress.num_updates == k and engine.progress.global_train_step == k


def _inf_grad_setup(k: int, guard: bool = True) -> tuple[Engine, dict]:
    """A model whose ``out.bias`` gradient (only that one) is +inf at global step ``k``; the loss is finite."""
    state = {"poison": False}

    def get_model(*, epoch, step, **_kwargs):
        model = TinyModel(dropout=0.0)
        model.out.bias.register_hook(lambda g: torch.full_like(g, math.inf) if state["poison"] else g)
        return model

    def train_step(*, model, extern_data, **_kwargs):
        state["poison"] = kit.get_run_ctx().step == k
        s, n = masked_ce(model, extern_data)
        kit.get_run_ctx().mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    return make_engine(get_model=get_model, train_step=train_step, stop_on_nonfinite_train_score=guard), state


def test_inf_in_one_gradient_raises_naming_it_and_changes_nothing():
    k = 2
    engine, _ = _inf_grad_setup(k)
    for _ in range(k):
        engine.train_step()
    before_params, before_opt = params(engine.model), _optimizer_snapshot(engine)
    with pytest.raises(kit.NonFiniteLossError) as info:
        engine.train_step()
    msg = str(info.value)
    assert f"step {k}" in msg and "gradient of out.bias" in msg
    assert "gradient of inp.weight" not in msg and "loss ce" not in msg  # only what was non-finite
    assert tensors_equal(params(engine.model), before_params)
    assert tensors_equal(_optimizer_snapshot(engine), before_opt)


def test_without_the_guard_an_inf_gradient_reaches_the_weights():
    # negative control for the two tests above: it is the guard that protects the weights
    engine, _ = _inf_grad_setup(0, guard=False)
    engine.train_step()
    assert not torch.isfinite(engine.model.out.bias).all()


def test_skip_policy_drops_the_update_and_goes_on():
    engine, state = _inf_grad_setup(1)
    engine.config.update(nonfinite_policy="skip")
    engine.train_step()
    before = params(engine.model)
    result = engine.train_step()
    assert not result.updated and tensors_equal(params(engine.model), before)
    assert engine.train_step().updated and engine.progress.skipped_updates_in_epoch == 1


# ---- learning rate control through training -----------------------------------------------


DEV_ERRORS = {1: 10.0, 2: 9.95, 3: 9.0, 4: 9.5, 5: 9.4}


def _dev_error_step(*, model, extern_data, **_kwargs):
    """Trains on CE; in eval also marks an error whose value per epoch is DEV_ERRORS."""
    s, n = masked_ce(model, extern_data)
    ctx = kit.get_run_ctx()
    ctx.mark_as_loss(s, "ce", custom_inv_norm_factor=n)
    if not ctx.train_flag:
        ctx.mark_as_loss(torch.full((), DEV_ERRORS[ctx.epoch]), "err", as_error=True)


# relative change (new - old) / new at epochs 1→2: -0.005 (not enough), 2→3: -0.106, 3→4: +0.053
LR_SEQUENCES = {
    "constant": ({}, [0.1] * 5),
    "learning_rates": ({"learning_rates": [0.3, 0.2, 0.1]}, [0.3, 0.2, 0.1, 0.1, 0.1]),
    "newbob": ({"learning_rate_control": "newbob"}, [0.1, 0.1, 0.05, 0.05, 0.025]),
    "newbob_abs": ({"learning_rate_control": "newbob_abs"}, [0.1, 0.1, 0.1, 0.1, 0.05]),
    # checks at epochs 1, 3, 5 on the mean relative change of the last 2 epoch pairs
    "newbob_multi_epoch": (
        {"learning_rate_control": "newbob_multi_epoch", "newbob_multi_num_epochs": 2},
        [0.1, 0.1, 0.05, 0.05, 0.05],
    ),
}


@pytest.mark.parametrize("scheme", list(LR_SEQUENCES))
def test_learning_rate_sequence_through_training(scheme):
    keys, expected = LR_SEQUENCES[scheme]
    engine = make_engine(
        train=Task12AXDataset(20, seed=1),
        dev=Task12AXDataset(10, seed=2),
        num_epochs=5,
        train_step=_dev_error_step,
        learning_rate=0.1,
        learning_rate_control_error_measure="dev_loss_err",
        **keys,
    )
    seen = {}

    def on_step_end(result):
        seen.setdefault(result.epoch, set()).add(engine.optimizer.param_groups[0]["lr"])

    engine.events.on("step_end", on_step_end)
    assert engine.train()
    table = [engine.scores.learning_rate(e) for e in range(1, 6)]
    assert table == pytest.approx(expected)
    # the optimizer really used each epoch's lr at every step
    assert [sorted(seen[e]) for e in range(1, 6)] == [[pytest.approx(v)] for v in expected]


def test_dynamic_learning_rate_arguments_and_effect():
    calls = []

    def dynamic_learning_rate(*, global_train_step, epoch, epoch_continuous, learning_rate, **kwargs):
        calls.append(
            dict(
                global_train_step=global_train_step,
                epoch=epoch,
                epoch_continuous=epoch_continuous,
                learning_rate=learning_rate,
            )
        )
        return learning_rate / (1 + global_train_step)

    engine = make_engine(
        dynamic_learning_rate=dynamic_learning_rate,
        num_epochs=3,
        learning_rate=0.2,
        train=Task12AXDataset(40, seed=1),
        dev=None,
    )
    used = []
    engine.events.on(
        "step_end",
        lambda result: used.append((result.learning_rate, engine.optimizer.param_groups[0]["lr"])),
    )
    engine.train()
    assert [c["global_train_step"] for c in calls] == list(range(len(calls)))  # every step
    assert {c["learning_rate"] for c in calls} == {0.2}  # the epoch's lr, not the previous dynamic one
    ec = [c["epoch_continuous"] for c in calls]
    assert ec == sorted(ec) and ec[0] == 0.0 and 2 < ec[-1] < 3  # RETURNN: the position before the step
    assert all(c["epoch"] - 1 <= c["epoch_continuous"] < c["epoch"] for c in calls)
    firsts = [c["epoch_continuous"] for i, c in enumerate(calls) if i == 0 or calls[i - 1]["epoch"] != c["epoch"]]
    assert firsts == [0.0, 1.0, 2.0]  # each epoch's first step: epoch - 1
    assert [u for u, _ in used] == pytest.approx([0.2 / (1 + i) for i in range(len(calls))])
    assert [o for _, o in used] == pytest.approx([u for u, _ in used])


# ---- weight decay groups through the engine -------------------------------------------------


class DecayModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(2, 9)
        self.norm = torch.nn.LayerNorm(9)
        self.lin = torch.nn.Linear(9, 2)

    def forward(self, x, labels):
        return self.lin(self.norm(x + self.emb(labels)))


def test_weight_decay_applies_to_weights_only():
    # a zero (not None) gradient: SGD's weight decay alone moves a parameter
    def train_step(*, model, extern_data, **_kwargs):
        out = model(extern_data["data"].tensor, extern_data["classes"].tensor)
        kit.get_run_ctx().mark_as_loss(out * 0.0, "zero")

    engine = make_engine(
        get_model=lambda **_: DecayModel(),
        train_step=train_step,
        optimizer={"class": "sgd", "weight_decay": 0.5},
        learning_rate=0.2,
    )
    engine.setup()
    before = params(engine.model)
    engine.train_step()
    after = params(engine.model)
    torch.testing.assert_close(after["lin.weight"], before["lin.weight"] * (1 - 0.2 * 0.5))
    for name in ("lin.bias", "norm.weight", "norm.bias", "emb.weight"):
        assert torch.equal(after[name], before[name]), name


# ---- host syncs ---------------------------------------------------------------------------


class HostReads(TorchDispatchMode):
    """Counts ops that hand a tensor value to Python (``.item()``, ``bool(t)``, ``float(t)``, ``torch.equal``)."""

    OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}

    def __init__(self, ignore_optimizer: bool = False):
        super().__init__()
        self.ignore_optimizer = ignore_optimizer
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            stack = traceback.extract_stack()
            if not (self.ignore_optimizer and any("/torch/optim/" in f.filename for f in stack)):
                self.reads.append(" <- ".join(f"{f.name}:{f.lineno}" for f in stack[-8:-2]))
        return func(*args, **(kwargs or {}))


def count_step_reads(engine: Engine, steps: int = 4, *, in_call: bool = False, **mode_kw) -> list[int]:
    """Host reads per ``engine.train_step()``, after the first step (which plans the epoch).

    The next batch is loaded before counting: loading builds host tensors from numpy
    (label range checks included) and is no device→host traffic on an accelerator.
    ``in_call``: the steps run inside one driver's train call (``guard.deferred_reads``),
    as Session.train_steps / train_epoch and the CLI run them.
    """
    engine.train_step()
    real = engine._training.pipeline
    counts = []
    try:
        with engine.driver_call() if in_call else contextlib.nullcontext():
            for _ in range(steps):
                engine._training.pipeline = OneBatch(real)
                with HostReads(**mode_kw) as mode:
                    engine.train_step()
                counts.append(len(mode.reads))
    finally:
        engine._training.pipeline = real
    return counts


class OneBatch:
    """The pipeline's next batch, loaded before the counting starts (its position still the pipeline's)."""

    def __init__(self, pipeline):
        self.pipeline, self.batch = pipeline, next(pipeline)

    def __next__(self):
        batch, self.batch = self.batch, None
        if batch is None:
            raise StopIteration
        return batch

    def state_dict(self):
        return self.pipeline.state_dict()


SGD_MOMENTUM = {"class": "sgd", "momentum": 0.9}


def test_train_step_makes_no_host_read_with_the_guard_off():
    engine = make_engine(stop_on_nonfinite_train_score=False, optimizer=SGD_MOMENTUM)
    assert count_step_reads(engine) == [0, 0, 0, 0]


def test_immediate_guard_reads_its_flag_once_per_micro_batch():
    # on a CPU device ("auto") the flag is host memory: one read per micro-batch, no sync
    engine = make_engine(optimizer=SGD_MOMENTUM, gradient_clip_global_norm=1.0)
    assert count_step_reads(engine) == [1, 1, 1, 1]
    assert engine._training.guard.options.mode == "immediate"
    engine = make_engine(optimizer=SGD_MOMENTUM, accum_grad_multiple_step=2)
    assert count_step_reads(engine) == [1, 1, 1, 1]  # every micro-batch's losses are checked


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("optimizer", [SGD_MOMENTUM, {"class": "adam", "fused": True}])
def test_deferred_guard_makes_no_host_read_per_step(accum, optimizer):
    engine = make_engine(optimizer=optimizer, nonfinite_check="deferred", accum_grad_multiple_step=accum,
                         gradient_clip_global_norm=1.0)
    assert count_step_reads(engine, in_call=True) == [0, 0, 0, 0]
    # the same steps as bare calls: each call's return is a read point (one read)
    assert count_step_reads(make_engine(optimizer=optimizer, nonfinite_check="deferred",
                                        accum_grad_multiple_step=accum), steps=2) == [1, 1]


def test_deferred_guard_reads_once_when_the_train_call_ends():
    engine = make_engine(optimizer=SGD_MOMENTUM, nonfinite_check="deferred")
    engine.train_step()
    with HostReads() as mode:
        with engine.driver_call():
            for _ in range(3):
                engine.train_step()
    not_loading = [r for r in mode.reads if "collate" not in r]  # loading reads host (numpy) tensors
    assert len(not_loading) == 1 and "read" in not_loading[0]


def test_adam_reads_only_its_own_step_counter():
    # torch's Adam reads its (host) step counter each update; nothing else reads
    engine = make_engine(optimizer={"class": "adam"}, stop_on_nonfinite_train_score=False)
    assert count_step_reads(engine, ignore_optimizer=True) == [0, 0, 0, 0]
    assert count_step_reads(engine, steps=1) != [0]  # what the exclusion above leaves out


def test_host_read_counter_sees_a_returnn_style_float_per_step():
    # negative control: a train_step that reads its loss like RETURNN does is counted
    def train_step(*, model, extern_data, **_kwargs):
        s, n = masked_ce(model, extern_data)
        float(s.detach()), float(n)  # RETURNN: float(loss.detach().cpu()) per loss per step
        kit.get_run_ctx().mark_as_loss(s, "ce", custom_inv_norm_factor=n)

    engine = make_engine(stop_on_nonfinite_train_score=False, optimizer=SGD_MOMENTUM, train_step=train_step)
    assert count_step_reads(engine, steps=2) == [2, 2]


def test_step_losses_are_read_when_asked_and_cached():
    engine = make_engine(stop_on_nonfinite_train_score=False, optimizer=SGD_MOMENTUM)
    result = engine.train_step()
    with HostReads() as first:
        losses = result.losses
    with HostReads() as again:
        assert result.losses == losses
    assert first.reads and not again.reads and set(losses) == {"ce", "fer"}


def test_epoch_sums_add_step_after_step_as_returnn_does():
    """Float64 losses over more steps than one block: the epoch totals equal adding each step onto
    the running total in turn, to the last bit (a vector sum adds in lanes, which rounds otherwise
    on some CPUs and broke the RETURNN round trips on an AVX-512 machine)."""
    from kit.engine.accounting import EpochAccounting, StepLosses

    gen = torch.Generator().manual_seed(3)
    sums = (torch.rand(100, generator=gen, dtype=torch.float64) * 1e3).unbind()
    norms = (torch.rand(100, generator=gen, dtype=torch.float64) + 0.5).unbind()
    acc = EpochAccounting()
    for s, n in zip(sums, norms):
        acc.add(StepLosses(["ce"], [s], [n]))
    total_sum, total_norm = 0.0, 0.0
    for s, n in zip(sums, norms):
        total_sum, total_norm = total_sum + float(s), total_norm + float(n)
    got = acc.totals["ce"].tolist()
    assert got == [total_sum, total_norm]
    assert got[0] != sum(sorted(map(float, sums)))  # the order shows in the last bit (else this test could not fail)
