"""RunCtx: RETURNN's loss semantics (sum, inverse norm factor, scale, as_error), outputs, activation."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kit
from kit.run_ctx import Loss, LossError, NoRunCtxError, RunCtx, get_run_ctx, mark_as_loss, run_ctx_scope


def train_ctx(**kw) -> RunCtx:
    return RunCtx("train", train_flag=True, epoch=1, step=0, **kw)


class SyncCounter(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``.item()``, ``bool(t)``, ``float(t)``)."""

    SYNC_OPS = ("aten._local_scalar_dense", "aten.item")

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(name) for name in self.SYNC_OPS):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


# ---- sums and norms ------------------------------------------------------------------------


def test_loss_is_summed_and_normalized_by_element_count():
    ctx = train_ctx()
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    entry = ctx.mark_as_loss(loss, "ce")
    assert isinstance(entry, Loss)
    assert entry.sum.item() == 21.0
    assert entry.inv_norm_factor.item() == 6
    assert entry.normalized().item() == pytest.approx(3.5)
    assert ctx.losses["ce"] is entry


def test_mask_sums_only_true_elements_and_counts_them():
    ctx = train_ctx()
    loss = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("nan")]])  # padding is garbage
    mask = torch.tensor([[True, True, False], [True, False, False]])
    entry = ctx.mark_as_loss(loss, "ce", mask=mask)
    assert entry.sum.item() == 7.0  # NaN/Inf in padding do not leak through the mask
    assert entry.inv_norm_factor.item() == 3
    assert entry.normalized().item() == pytest.approx(7 / 3)


def test_broadcast_mask_counts_broadcast_elements():
    ctx = train_ctx()
    loss = torch.ones(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, False, False]])[:, :, None]  # (2,3,1)
    entry = ctx.mark_as_loss(loss, "ce", mask=mask)
    assert entry.sum.item() == 12.0
    assert entry.inv_norm_factor.item() == 12


def test_bad_mask_is_refused():
    ctx = train_ctx()
    with pytest.raises(kit.DataError, match="bool"):
        ctx.mark_as_loss(torch.ones(2, 3), "ce", mask=torch.ones(2, 3))
    with pytest.raises(kit.DataError, match="broadcast"):
        ctx.mark_as_loss(torch.ones(2, 3), "ce2", mask=torch.ones(2, 3, 5, dtype=torch.bool))


@pytest.mark.parametrize("factor, expected", [(torch.tensor([2.0, 3.0]), 5.0), (4, 4), (2.5, 2.5)])
def test_custom_inv_norm_factor_overrides_the_count(factor, expected):
    ctx = train_ctx()
    entry = ctx.mark_as_loss(torch.ones(2, 3), "ce", custom_inv_norm_factor=factor)
    assert entry.inv_norm_factor.item() == pytest.approx(expected)
    assert entry.normalized().item() == pytest.approx(6.0 / expected)


# ---- gradients -----------------------------------------------------------------------------


def test_gradient_uses_scaled_sum_by_default():
    x = torch.ones(4, requires_grad=True)
    ctx = train_ctx()
    ctx.mark_as_loss(x * 2.0, "ce", scale=0.5)
    ctx.total_loss().backward()
    assert torch.equal(x.grad, torch.full((4,), 1.0))  # d(0.5 * sum(2x))/dx = 1, not 1/4


def test_gradient_with_use_normalized_loss_divides_by_norm():
    x = torch.ones(4, requires_grad=True)
    ctx = train_ctx()
    entry = ctx.mark_as_loss(x * 2.0, "ce", scale=0.5, use_normalized_loss=True)
    ctx.total_loss().backward()
    assert torch.allclose(x.grad, torch.full((4,), 0.25))
    assert entry.normalized().item() == pytest.approx(2.0)  # reported value ignores scale


def test_error_losses_are_reported_but_never_differentiated():
    x = torch.ones(3, requires_grad=True)
    ctx = train_ctx()
    ctx.mark_as_loss(x.sum() * 0 + x, "ce")
    fer = ctx.mark_as_loss(x * 10.0, "fer", as_error=True)
    assert not fer.sum.requires_grad
    assert fer.normalized().item() == pytest.approx(10.0)
    ctx.total_loss().backward()
    assert torch.equal(x.grad, torch.ones(3))  # only "ce" contributed


def test_total_loss_sums_all_differentiable_losses():
    x = torch.ones(2, requires_grad=True)
    ctx = train_ctx()
    ctx.mark_as_loss(x, "a")
    ctx.mark_as_loss(3 * x, "b", scale=2.0)
    assert ctx.total_loss().item() == pytest.approx(2 + 12)


def test_only_error_losses_in_training_is_a_clear_error():
    ctx = train_ctx()
    ctx.mark_as_loss(torch.ones(3), "fer", as_error=True)
    with pytest.raises(kit.KitError, match=r"only error losses \(as_error=True\): fer.*mark_as_loss"):
        ctx.total_loss()
    with pytest.raises(kit.KitError, match="mark at least one differentiable loss"):
        train_ctx().total_loss()


def test_eval_total_loss_without_differentiable_losses_is_zero():
    ctx = RunCtx("eval", train_flag=False, epoch=1, step=0)
    ctx.mark_as_loss(torch.ones(3), "fer", as_error=True)
    assert ctx.total_loss().item() == 0.0


def test_duplicate_loss_name_is_an_error():
    ctx = train_ctx()
    ctx.mark_as_loss(torch.ones(3), "ce")
    with pytest.raises(LossError, match="'ce' was already marked"):
        ctx.mark_as_loss(torch.ones(3), "ce")


def test_losses_keep_insertion_order():
    ctx = train_ctx()
    for name in ("z", "a", "m"):
        ctx.mark_as_loss(torch.ones(1), name)
    assert list(ctx.losses) == ["z", "a", "m"]


def test_mark_as_loss_makes_no_device_to_host_sync():
    loss = torch.rand(4, 7, requires_grad=True)
    mask = torch.rand(4, 7) > 0.3
    ctx = train_ctx()
    with SyncCounter() as counter:
        ctx.mark_as_loss(loss, "ce", mask=mask, scale=0.3)
        ctx.mark_as_loss(loss * 2, "fer", as_error=True, custom_inv_norm_factor=mask.sum(-1))
        ctx.mark_as_loss(loss, "n", use_normalized_loss=True, custom_inv_norm_factor=2.5)
        for entry in ctx.losses.values():
            entry.normalized()
        ctx.total_loss()
    assert counter.syncs == []


def test_sync_counter_detects_a_sync():
    # negative control: the counter used above does see an .item()
    with SyncCounter() as counter:
        torch.ones(3).sum().item()
    assert counter.syncs


# ---- the active context --------------------------------------------------------------------


def test_get_run_ctx_outside_a_step_is_a_clear_runtime_error():
    with pytest.raises(
        RuntimeError, match=r"get_run_ctx\(\) is only available inside train_step/forward_step"
    ):
        get_run_ctx()
    with pytest.raises(NoRunCtxError):
        kit.get_run_ctx()


def test_scope_installs_and_restores_nested_contexts():
    outer, inner = train_ctx(), RunCtx("eval", train_flag=False, epoch=2, step=5)
    with run_ctx_scope(outer):
        assert kit.get_run_ctx() is outer
        with inner.activate():
            assert get_run_ctx() is inner
            mark_as_loss(torch.ones(2), "ce")  # module-level shorthand goes to the active one
        assert get_run_ctx() is outer
    assert "ce" in inner.losses and not outer.losses
    with pytest.raises(RuntimeError):
        get_run_ctx()


def test_scope_restores_after_an_exception():
    with pytest.raises(ZeroDivisionError), run_ctx_scope(train_ctx()):
        1 / 0  # noqa: B018
    with pytest.raises(RuntimeError):
        get_run_ctx()


def test_contexts_in_threads_are_independent():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name: str):
        ctx = RunCtx("train", train_flag=True, epoch=1, step=0)
        with run_ctx_scope(ctx):
            barrier.wait()
            mark_as_loss(torch.ones(1), name)
            barrier.wait()
            seen[name] = list(get_run_ctx().losses)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": ["a"], "b": ["b"]}


def test_bad_stage_is_refused():
    with pytest.raises(ValueError, match="stage"):
        RunCtx("training", train_flag=True, epoch=1, step=0)


# ---- outputs -------------------------------------------------------------------------------


def test_mark_as_output_and_default_output():
    ctx = RunCtx("forward", train_flag=False, epoch=1, step=0)
    logits, lengths = torch.zeros(2, 5, 3), torch.tensor([5, 4])
    ctx.mark_as_output(logits, "logits", lengths=lengths)
    ctx.mark_as_default_output(logits.argmax(-1))
    assert list(ctx.outputs) == ["logits", "output"]
    assert ctx.outputs["logits"].tensor is logits and ctx.outputs["logits"].lengths is lengths
    with pytest.raises(kit.DataError, match="already marked"):
        ctx.mark_as_output(logits, "logits")


def test_check_outputs_names_missing_and_unexpected():
    ctx = RunCtx("forward", train_flag=False, epoch=1, step=0, expected_outputs=["logits", "align"])
    ctx.mark_as_output(torch.zeros(2, 5, 3), "logits")
    with pytest.raises(kit.DataError, match="missing outputs.*align"):
        ctx.check_outputs()
    with pytest.raises(kit.DataError, match="'extra' is not declared in model_outputs"):
        ctx.mark_as_output(torch.zeros(2), "extra")
    ctx.mark_as_output(torch.zeros(2, 5), "align")
    ctx.check_outputs()


def test_expected_output_shape_is_checked():
    ctx = RunCtx(
        "forward", train_flag=False, epoch=1, step=0, expected_outputs={"logits": {"shape": (None, 3)}}
    )
    with pytest.raises(kit.DataError, match="shape"):
        ctx.mark_as_output(torch.zeros(2, 5, 4), "logits")
    ctx.mark_as_output(torch.zeros(2, 7, 3), "logits")
    ctx.check_outputs()


def test_repr_names_losses_without_tensor_values():
    ctx = train_ctx()
    ctx.mark_as_loss(torch.full((3,), 7.25), "ce")
    text = repr(ctx)
    assert "losses=['ce']" in text and "7.25" not in text and "tensor" not in text
