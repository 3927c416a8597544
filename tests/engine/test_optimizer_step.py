"""``torch_optimizer_step``: RETURNN's options and limits as config errors, and on the CPU the Inductor-compiled
optimizer step (``compile``, ``capture=False``) against the eager one: per-step losses and weights, the LR
schedule seen through the device lr, a resumed run, a custom optimizer's Python-int counter. The CUDA capture
is checked by ``benchmarks/gpu_check.py`` (case ``optimizer_step``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.models import tiny_config

import kit
from kit.engine.engine import Engine
from kit.engine.optimizer_step import OptimizerStepOptions
from kit.engine.state import TrainingState

COMPILE = {"compile": True, "capture": False}
TOLERANCE = 1e-5  # relative, per step loss: Inductor fuses the update's float32 arithmetic differently


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """Inductor's compiled kernels under the test's temporary directory (shared by this file's compiles)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def halving_lr(*, global_train_step, learning_rate, **_kwargs):
    return learning_rate * 0.7 ** global_train_step  # a new lr every step: the device lr must follow


def engine(**overrides) -> Engine:
    overrides.setdefault("dynamic_learning_rate", halving_lr)
    return Engine(kit.Config(tiny_config(None, device="cpu", **overrides)))


def run(e: Engine, n: int) -> list[float]:
    return [e.train_step().losses["ce"] for _ in range(n)]


def dynamo_graphs() -> int:
    """Graphs torch.compile made so far in this process (torch's own counter; there is no public one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def assert_same_training(a: list[float], b: list[float], ea: Engine, eb: Engine) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert y == pytest.approx(x, rel=TOLERANCE), f"step {i}"
    for (name, pa), pb in zip(ea.model.named_parameters(), eb.model.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-6, msg=name)


# ---- options and limits ---------------------------------------------------------------------


def test_options_take_returnn_defaults():
    assert OptimizerStepOptions.parse({}) == OptimizerStepOptions(compile=True, capture=True, dynamic_state_keys=())


@pytest.mark.parametrize("value, says", [
    ({"compil": True}, "unknown option(s) ['compil']"),
    ({"capture": "yes"}, "'capture' must be True or False"),
    ({"dynamic_state_keys": "step"}, "'dynamic_state_keys' must be a list"),
    ([True], "expected a dict"),
])
def test_a_wrong_value_is_a_config_error_naming_the_key_and_option(value, says):
    with pytest.raises(kit.ConfigError, match="torch_optimizer_step") as info:
        kit.Config({"torch_optimizer_step": value})
    assert says in str(info.value)


@pytest.mark.parametrize("overrides, says", [
    ({"torch_optimizer_step": {}}, r"'capture' records a CUDA graph and needs a CUDA device"),  # capture: default
    ({"torch_optimizer_step": COMPILE, "torch_amp": "float16", "grad_scaler": {}}, "GradScaler"),
    ({"torch_optimizer_step": COMPILE, "torch_cuda_graph": {"batch_size_bound": 10, "capture_optimizer": True,
                                                            "compile": True}}, "capture_optimizer"),
])
def test_returnn_limits_are_config_errors(overrides, says):
    with pytest.raises(kit.ConfigError, match="torch_optimizer_step") as info:
        engine(**overrides).train_step()
    assert info.match(says)


# ---- the compiled step on the CPU -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [{"class": "adam"}, {"class": "adamw", "weight_decay": 0.01}])
def test_compiled_step_trains_as_the_eager_one(optimizer, caplog):
    """The lr changes every step (halving_lr): a graph that froze the lr would train differently from step 2."""
    n = 5
    eager = engine(optimizer=optimizer)
    eager_losses = run(eager, n)
    graphs = dynamo_graphs()
    with caplog.at_level(logging.INFO, logger="kit"):
        compiled = engine(optimizer=optimizer, torch_optimizer_step=COMPILE)
        compiled_losses = run(compiled, n)
    assert dynamo_graphs() > graphs  # Inductor compiled the update: not an eager fallback
    runner = compiled.compiled_optimizer_step
    assert (runner.eager_steps, runner.compiled_steps, runner.compiles) == (1, n - 1, 1)  # the phases
    assert "torch_optimizer_step: compiling the optimizer step" in caplog.text
    assert isinstance(compiled.optimizer.param_groups[0]["lr"], torch.Tensor)  # the device lr, in place
    assert_same_training(eager_losses, compiled_losses, eager, compiled)
    lr = eager.optimizer.param_groups[0]["lr"]
    assert compiled.optimizer.param_groups[0]["lr"].item() == pytest.approx(lr, rel=1e-6)
    # gradients stay where they are while this is on (a captured step reads them there)
    assert all(prm.grad is not None for prm in compiled.model.parameters())


def test_a_resumed_run_continues_as_an_uninterrupted_one(tmp_path):
    whole = engine(torch_optimizer_step=COMPILE)
    whole_losses = run(whole, 6)
    first = engine(torch_optimizer_step=COMPILE)
    first_losses = run(first, 3)
    path = tmp_path / "state.pt"
    torch.save(first.capture().to_file(), path)
    state = torch.load(path, weights_only=False)
    groups = state["optimizer"]["param_groups"]
    assert all(type(g["lr"]) is float for g in groups)  # RETURNN's checkpoint: Python scalars
    resumed = engine(torch_optimizer_step=COMPILE)
    resumed.restore_state(TrainingState.from_file(state, weights=first.model.state_dict()))
    resumed_losses = run(resumed, 3)
    assert resumed.compiled_optimizer_step.compiled_steps == 2  # one eager step after the load, then compiled
    assert_same_training(whole_losses, first_losses + resumed_losses, whole, resumed)


class CountingSGD(torch.optim.Optimizer):
    """SGD with a 1/step decay, written for a float lr, its step counter a Python int in the state."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for prm in group["params"]:
                if prm.grad is None:
                    continue
                state = self.state[prm]
                state["step"] = state.get("step", 0) + 1
                prm.add_(prm.grad, alpha=-group["lr"] / state["step"])


def test_a_python_scalar_in_the_optimizer_state_needs_dynamic_state_keys(tmp_path):
    opts = {"optimizer": {"class": CountingSGD}, "learning_rate": 0.5}
    with pytest.raises(kit.ConfigError, match=r"torch_optimizer_step.*'step' is a Python int.*dynamic_state_keys"):
        run(engine(**opts, torch_optimizer_step=COMPILE), 2)  # the first (eager) step creates it; the second says
    eager = engine(**opts)
    eager_losses = run(eager, 4)
    listed = engine(**opts, torch_optimizer_step={**COMPILE, "dynamic_state_keys": ["step"]})
    listed_losses = run(listed, 4)
    assert listed.compiled_optimizer_step.compiled_steps == 3
    assert_same_training(eager_losses, listed_losses, eager, listed)
    state = listed.capture().optimizer
    assert state is not None
    assert {type(s["step"]) for s in state["state"].values()} == {int}  # a Python int again in the checkpoint
    assert {s["step"] for s in state["state"].values()} == {4}


# ---- the capture's bookkeeping, with a stand-in for the CUDA graph ---------------------------------------


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on the CPU: counts replays (the bookkeeping, not the numbers)."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_a_replaced_tensor_or_a_loaded_state_is_captured_again(monkeypatch, caplog):
    from contextlib import nullcontext

    from kit.engine.optimizer_step import OptimizerStep

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **_: nullcontext())
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    runner = OptimizerStep(opt, OptimizerStepOptions(compile=False, capture=True))

    def update(set_to_none: bool = False):
        opt.zero_grad(set_to_none=set_to_none)
        model(torch.ones(1, 3)).sum().backward()
        runner.step()

    for _ in range(5):
        update()
    assert (runner.eager_steps, runner.captures, runner.replays) == (2, 1, 3)  # eager, warm, capture, 2 replays
    with caplog.at_level(logging.INFO, logger="kit"):
        update(set_to_none=True)  # new gradient tensors: the graph would read the old ones
    assert "replaced; capturing again" in caplog.text
    assert (runner.eager_steps, runner.captures, runner.replays) == (3, 1, 3)  # a warm run outside any capture
    update()
    update()
    assert (runner.captures, runner.replays) == (2, 5)  # captured again, then replayed
    state = runner.host_state_dict(opt.state_dict())
    assert type(state["param_groups"][0]["lr"]) is float
    opt.load_state_dict(state)  # what Updater.load_state_dict does, then invalidate
    runner.invalidate()
    update()
    update()
    assert (runner.eager_steps, runner.captures) == (4, 3)  # a warm eager step on the new state, then capture
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
