"""Updater: optimizer from config, weight-decay groups, lr multipliers, clipping, noise, state."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kit.config import Config
from kit.engine.updater import Updater, total_grad_norm
from kit.errors import ConfigError, KitError


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight  # tied: shared between Embedding and Linear
        self.gain = torch.nn.Parameter(torch.ones(4))  # 1-d: no decay


def make(model=None, **config):
    config.setdefault("optimizer", {"class": "adamw"})
    config.setdefault("learning_rate", 0.1)
    return Updater(Config(**config), model if model is not None else Tiny())


def group_of(updater, param):
    hits = [i for i, g in enumerate(updater.optimizer.param_groups) for p in g["params"] if p is param]
    assert len(hits) == 1, hits
    return updater.optimizer.param_groups[hits[0]]


# ---- optimizer class ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, cls",
    [
        ({"class": "adamw"}, torch.optim.AdamW),
        ({"class": "AdamW"}, torch.optim.AdamW),
        ({"class": "sgd", "momentum": 0.9}, torch.optim.SGD),
        ({"class": "RMSprop"}, torch.optim.RMSprop),
        ({"class": "torch.optim.Adagrad"}, torch.optim.Adagrad),
        ({"class": torch.optim.Adam}, torch.optim.Adam),
        (torch.optim.SGD, torch.optim.SGD),
    ],
)
def test_optimizer_class_by_name_path_or_type(spec, cls):
    updater = make(optimizer=spec)
    assert type(updater.optimizer) is cls
    assert all(g["lr"] == 0.1 for g in updater.optimizer.param_groups)


def test_optimizer_factory_callable():
    calls = {}

    def factory(params, **kw):
        calls.update(kw)
        return torch.optim.SGD(params, **kw)

    updater = make(optimizer=factory)
    assert isinstance(updater.optimizer, torch.optim.SGD) and calls == {"lr": 0.1}
    updater = make(optimizer={"class": factory, "momentum": 0.5})
    assert updater.optimizer.param_groups[0]["momentum"] == 0.5


def test_missing_optimizer_is_a_clear_error():
    with pytest.raises(ConfigError, match="config key 'optimizer' is not set"):
        Updater(Config(learning_rate=0.1), Tiny())


def test_lr_inside_optimizer_points_to_learning_rate():
    with pytest.raises(ConfigError, match="learning_rate"):
        make(optimizer={"class": "adamw", "lr": 1e-3})


def test_unknown_optimizer_name_and_kwargs_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown optimizer class 'adamx'.*adamw"):
        make(optimizer={"class": "adamx"})
    with pytest.raises(ConfigError, match="SGD does not accept 'betas'"):
        make(optimizer={"class": "sgd", "betas": (0.9, 0.99)})
    with pytest.raises(ConfigError, match="cannot import"):
        make(optimizer={"class": "torch.optim.NoSuchThing"})


def test_epsilon_is_an_alias_of_eps():
    updater = make(optimizer={"class": "adam", "epsilon": 1e-16})
    assert updater.optimizer.param_groups[0]["eps"] == 1e-16


# ---- weight decay groups --------------------------------------------------------------------


def test_no_weight_decay_means_one_group():
    updater = make()
    assert len(updater.optimizer.param_groups) == 1


def test_weight_decay_groups_are_returnns_each_param_once():
    """RETURNN's default: biases, LayerNorm and Embedding do not decay; BatchNorm weights and other
    1-d parameters do; each group is sorted by parameter name."""
    model = Tiny()
    updater = make(model, optimizer={"class": "adamw", "weight_decay": 0.01})
    params = [p for g in updater.optimizer.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    for p in (model.lin.weight, model.bn.weight, model.gain):
        assert group_of(updater, p)["weight_decay"] == 0.01
    for p in (model.lin.bias, model.norm.weight, model.norm.bias, model.emb.weight):
        assert group_of(updater, p)["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    for group in updater.optimizer.param_groups:
        group_names = [names[id(p)] for p in group["params"]]
        assert group_names == sorted(group_names)


def test_weight_decay_modules_blacklist_replaces_the_default():
    model = Tiny()
    updater = make(
        model,
        optimizer={"class": "adamw", "weight_decay": 0.01},
        weight_decay_modules_blacklist=["torch.nn.Linear"],
    )
    assert group_of(updater, model.lin.weight)["weight_decay"] == 0.0
    assert group_of(updater, model.norm.weight)["weight_decay"] == 0.01  # LayerNorm no longer listed
    assert group_of(updater, model.emb.weight)["weight_decay"] == 0.01  # Embedding no longer listed
    assert group_of(updater, model.lin.bias)["weight_decay"] == 0.0


def test_weight_decay_custom_include_check():
    model = Tiny()
    seen = []

    def check(*, module, rf_module, full_param_name, param):  # RETURNN's arguments, no **kwargs needed
        seen.append((id(module), full_param_name))
        assert rf_module is None  # a plain torch module
        if isinstance(module, torch.nn.LayerNorm):
            return True
        if isinstance(module, torch.nn.Linear) and full_param_name == "weight":  # RETURNN: the name in the module
            return False
        return None

    updater = make(
        model, optimizer={"class": "adamw", "weight_decay": 0.01, "weight_decay_custom_include_check": check}
    )
    assert group_of(updater, model.norm.weight)["weight_decay"] == 0.01
    assert group_of(updater, model.lin.weight)["weight_decay"] == 0.0
    assert group_of(updater, model.emb.weight)["weight_decay"] == 0.0  # None: default rule
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))


def test_custom_check_must_return_bool_or_none():
    with pytest.raises(ConfigError, match="expected True, False or None"):
        make(
            optimizer={"class": "adamw", "weight_decay": 0.1},
            weight_decay_custom_include_check=lambda **kw: 1,
        )


# ---- learning rate ---------------------------------------------------------------------------


def test_param_groups_custom_with_learning_rate_multiplier():
    model = Tiny()

    def groups(*, model, **kw):
        return [
            {"params": [model.lin.weight, model.lin.bias], "learning_rate_multiplier": 0.1},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("lin.")]},
        ]

    updater = make(model, param_groups_custom=groups)
    assert group_of(updater, model.lin.weight)["lr"] == pytest.approx(0.01)
    updater.set_learning_rate(2.0)
    assert updater.learning_rate == 2.0
    assert group_of(updater, model.lin.weight)["lr"] == pytest.approx(0.2)
    assert group_of(updater, model.norm.weight)["lr"] == 2.0
    assert all(isinstance(g["lr"], float) for g in updater.optimizer.param_groups)


def test_optimizer_level_learning_rate_multiplier():
    updater = make(optimizer={"class": "sgd", "learning_rate_multiplier": 0.5})
    updater.set_learning_rate(1.0)
    assert updater.optimizer.param_groups[0]["lr"] == 0.5


# ---- gradients --------------------------------------------------------------------------------


def with_grads(updater, values):
    params = updater.parameters()
    for p, v in zip(params, values):
        p.grad = torch.full_like(p, v)
    return params


def test_clip_value_then_global_norm_returns_norm_before_clipping():
    model = torch.nn.Linear(3, 1)  # weight 3 + bias 1 = 4 elements
    updater = make(model, gradient_clip=2.0, gradient_clip_global_norm=1.0)
    with_grads(updater, [5.0, -5.0])  # value-clipped to ±2 → norm sqrt(4*4) = 4
    norm = updater.clip_gradients()
    assert isinstance(norm, torch.Tensor) and norm.item() == pytest.approx(4.0)
    assert total_grad_norm(updater.parameters()).item() == pytest.approx(1.0, rel=1e-5)


def test_clip_norm_alias_and_no_norm_without_request():
    model = torch.nn.Linear(3, 1)
    updater = make(model, gradient_clip_norm=0.5)
    with_grads(updater, [1.0, 1.0])
    assert updater.clip_gradients().item() == pytest.approx(2.0)
    plain = make(torch.nn.Linear(3, 1))
    with_grads(plain, [1.0, 1.0])
    assert plain.clip_gradients() is None
    assert plain.clip_gradients(need_grad_norm=True).item() == pytest.approx(2.0)
    assert plain.parameters()[0].grad.eq(1.0).all()  # nothing clipped


def test_gradient_noise():
    model = torch.nn.Linear(300, 1)
    quiet = make(model)
    with_grads(quiet, [0.0, 0.0])
    quiet.apply_gradient_noise()
    assert model.weight.grad.eq(0).all()
    noisy = make(model, gradient_noise=0.1)
    torch.manual_seed(0)
    noisy.apply_gradient_noise()
    grad = model.weight.grad
    assert grad.abs().gt(0).all() and grad.abs().le(0.2).all()
    assert 0.07 < grad.std().item() < 0.1  # truncated at 2 std: std ≈ 0.088


class SyncCounter(TorchDispatchMode):
    """Counts ops that read a device value back to the host."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(("aten._local_scalar_dense", "aten.item")):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_clip_and_noise_make_no_host_sync():
    model = torch.nn.Linear(3, 2)
    updater = make(model, gradient_clip=1.0, gradient_clip_global_norm=1.0, gradient_noise=0.01)
    model(torch.randn(4, 3)).sum().backward()
    with SyncCounter() as counter:
        updater.set_learning_rate(0.05)
        updater.apply_gradient_noise()
        norm = updater.clip_gradients(need_grad_norm=True)
    assert counter.syncs == []  # (optimizer.step itself is torch's business: CPU step counters)
    assert norm is not None
    with SyncCounter() as counter:  # negative control: torch's own trunc_normal_ does sync
        torch.nn.init.trunc_normal_(torch.empty(3))
    assert counter.syncs


# ---- state -------------------------------------------------------------------------------------


def test_state_round_trip():
    torch.manual_seed(0)
    model = Tiny()
    updater = make(model, optimizer={"class": "adamw", "weight_decay": 0.01})
    x = torch.randint(0, 5, (3,))
    model.lin(model.emb(x)).sum().backward()
    updater.optimizer.step()
    updater.set_learning_rate(0.03)
    state = updater.state_dict()

    other_model = Tiny()
    other_model.load_state_dict(model.state_dict())
    other = make(other_model, optimizer={"class": "adamw", "weight_decay": 0.01})
    other.load_state_dict(state)
    assert other.learning_rate == 0.03
    assert other.optimizer.param_groups[0]["lr"] == 0.03
    a = updater.optimizer.state[model.lin.weight]["exp_avg"]
    b = other.optimizer.state[other_model.lin.weight]["exp_avg"]
    assert torch.equal(a, b)


def test_state_from_a_different_grouping_is_refused():
    model = Tiny()
    state = make(model).state_dict()
    with pytest.raises(KitError, match="parameter groups"):
        make(model, optimizer={"class": "adamw", "weight_decay": 0.01}).load_state_dict(state)


# ---- zero_grad ------------------------------------------------------------------------------


def test_zero_grad_sets_every_gradient_of_every_group_to_none():
    updater = make(optimizer={"class": "adamw", "weight_decay": 0.1})  # two groups
    params = updater.parameters()
    for p in params:
        p.grad = torch.ones_like(p)
    updater.zero_grad()
    assert len(updater.optimizer.param_groups) == 2 and all(p.grad is None for p in params)


def test_zero_grad_of_an_optimizer_with_its_own_is_that_one():
    calls = []

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    updater = make(optimizer={"class": Own})
    updater.zero_grad()
    assert calls == [True]


def _lr_multipliers_by_patterns(*, model, optimizer_opts, **_kw):
    """A param_groups_custom as RETURNN setups write it: it takes its own option out of the optimizer options."""
    import fnmatch

    patterns = optimizer_opts.pop("learning_rate_multipliers_by_patterns")
    groups: dict[float, list] = {}
    for name, param in model.named_parameters():
        factor = next((f for pattern, f in patterns.items() if fnmatch.fnmatchcase(name, pattern)), 1.0)
        groups.setdefault(factor, []).append(param)
    return [{"params": params, "learning_rate_multiplier": f, "weight_decay": optimizer_opts.get("weight_decay", 0.0)}
            for f, params in groups.items()]


def test_learning_rate_multipliers_by_patterns_through_param_groups_custom():
    model = Tiny()
    updater = make(model, optimizer={"class": "adamw", "param_groups_custom": _lr_multipliers_by_patterns,
                                     "learning_rate_multipliers_by_patterns": {"lin.*": 0.1}, "weight_decay": 0.01})
    assert group_of(updater, model.lin.weight)["lr"] == pytest.approx(0.01)
    assert group_of(updater, model.norm.weight)["lr"] == pytest.approx(0.1)
    assert "learning_rate_multipliers_by_patterns" not in updater.optimizer.defaults


def test_an_option_param_groups_custom_leaves_behind_is_named():
    def keeps_it(*, model, **_kw):
        return [{"params": list(model.parameters())}]

    with pytest.raises(ConfigError, match="learning_rate_multipliers_by_patterns.*param_groups_custom left it"):
        make(Tiny(), optimizer={"class": "adamw", "param_groups_custom": keeps_it,
                                "learning_rate_multipliers_by_patterns": {"lin.*": 0.1}})
