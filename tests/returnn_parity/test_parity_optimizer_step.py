"""``torch_optimizer_step`` against RETURNN's own (``returnn.torch.util.optimizer_step``), compiled on the CPU
(``{"compile": True, "capture": False}``): the same model, the same gradients and a learning rate that changes
every step; per-step losses and weights within a float32 tolerance (both compile the update with Inductor, each
in its own way), and the checkpoint's optimizer state with the same Python scalars.

torch's SGD with momentum and a custom optimizer with a Python-int counter (``dynamic_state_keys``): RETURNN's
AOT trace cannot compile torch's Adam on the CPU (it reads Adam's host step counter), kit's can
(tests/engine/test_optimizer_step.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("returnn", reason="parity tests need RETURNN (pip install returnn)")

from returnn.torch.util.optimizer_step import OptimizerStep as ReturnnOptimizerStep  # noqa: E402

from kit.engine.optimizer_step import OptimizerStep, OptimizerStepOptions  # noqa: E402

STEPS = 5
TOLERANCE = 1e-5  # relative: two Inductor compiles of the same float32 update


class CountingSGD(torch.optim.Optimizer):
    """SGD with a 1/step decay, written for a float lr, its step counter a Python int in the state, counted in
    place (``+=``): RETURNN's trace keeps only in-place changes of the state, so a counter that the optimizer
    rebinds (``s["step"] = s["step"] + 1``) stays frozen in RETURNN's compiled step; in kit's it counts (as
    tests/engine/test_optimizer_step.py checks against the eager step)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for prm in group["params"]:
                if prm.grad is not None:
                    state = self.state[prm]
                    state.setdefault("step", 0)
                    state["step"] += 1
                    prm.add_(prm.grad, alpha=-group["lr"] / state["step"])


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """As RETURNN's updater sets it: in place into a device lr, else the float."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: object) -> list[float]:
    gen = torch.Generator().manual_seed(3)
    losses = []
    for i in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
        set_lr(optimizer, 0.05 * 0.8 ** i)
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        step.step()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make, keys", [
    (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), []),
    (lambda params: CountingSGD(params, lr=0.05), ["step"]),
])
def test_compiled_optimizer_step_trains_as_returnns(make, keys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    runs = {}
    for who in ("returnn", "kit"):
        m = copy.deepcopy(model)
        opt = make(m.parameters())
        if who == "returnn":
            step = ReturnnOptimizerStep(optimizer=opt, opts={"compile": True, "capture": False,
                                                             "dynamic_state_keys": keys})
        else:
            step = OptimizerStep(opt, OptimizerStepOptions(compile=True, capture=False, dynamic_state_keys=tuple(keys)))
        runs[who] = (m, opt, step, train(m, opt, step))
    (rm, ropt, rstep, rlosses), (km, kopt, kstep, klosses) = runs["returnn"], runs["kit"]
    assert kstep.compiled_steps == STEPS - 1
    assert klosses == pytest.approx(rlosses, rel=TOLERANCE)
    for (name, pr), pk in zip(rm.named_parameters(), km.parameters()):
        torch.testing.assert_close(pk, pr, rtol=1e-5, atol=1e-7, msg=name)
    want = rstep.state_dict_to_host_scalars(ropt.state_dict())
    got = kstep.host_state_dict(kopt.state_dict())
    assert [type(g["lr"]) for g in got["param_groups"]] == [type(g["lr"]) for g in want["param_groups"]] == [float]
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys()
        for k, v in state.items():
            assert type(got["state"][i][k]) is type(v), k
            if not isinstance(v, torch.Tensor):
                assert got["state"][i][k] == v, k
