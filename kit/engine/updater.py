"""``Updater``: the optimizer built from config ``optimizer``, parameter groups, LR, clipping, noise.

>>> updater = Updater(Config(optimizer={"class": "adamw", "weight_decay": 0.01}, learning_rate=1e-3), model)
>>> updater.set_learning_rate(5e-4)       # every group: 5e-4 × its learning_rate_multiplier
>>> norm = updater.clip_gradients()      # a device tensor (or None); never read back here

Nothing here moves a number from the device to the host: clipping returns the total norm as a
tensor, and learning rates are plain Python floats set on the parameter groups.

``optimizer`` may be ``{"class": name | "pkg.mod.Class" | type | factory, **kwargs}``, an
optimizer class, or a factory ``f(params, lr=.., **kwargs) -> Optimizer``. Like RETURNN:
``epsilon`` is an alias of ``eps``, ``lr`` inside is refused (set ``learning_rate``), and with
``weight_decay`` the parameters of ``LayerNorm`` / ``Embedding`` (or ``weight_decay_modules_blacklist``)
and every parameter named ``*bias`` go into a second group with ``weight_decay=0``; each group
lists its parameters sorted by name, as RETURNN's, so that RETURNN's ``.opt.pt`` files load. Unlike RETURNN, an unset ``eps`` keeps torch's default
(RETURNN sets 1e-16).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kit.config import Config
from kit.engine.optimizer_check import (  # noqa: F401 - resolve_* and optimizer_classes: public here too
    check_optimizer,
    keyword_problems,
    optimizer_classes,
    resolve_dotted,
    resolve_optimizer_class,
)
from kit.engine.optimizer_step import OptimizerStep, OptimizerStepOptions
from kit.errors import ConfigError, KitError
from kit.signatures import keyword_names

# options of the optimizer dict that kit consumes (RETURNN's places for them); not passed to torch
_GROUPING_OPTS = (
    "weight_decay_modules_blacklist",
    "weight_decay_custom_include_check",
    "param_groups_custom",
)


def default_weight_decay_blacklist() -> tuple[type, ...]:
    """Module types whose parameters never decay by default: RETURNN's LayerNorm and Embedding."""
    return (torch.nn.LayerNorm, torch.nn.Embedding)


class Updater:
    """Wraps the ``torch.optim.Optimizer`` built from config; sets LR, clips and noises gradients."""

    def __init__(self, config: Config, model: torch.nn.Module, *, grad_scaler: bool = False):
        self.config = config
        self.model = model
        self.learning_rate: float = config.float("learning_rate")
        self._grad_clip = config.float("gradient_clip")
        self._grad_clip_norm = _clip_norm_setting(config)
        self._grad_noise = config.float("gradient_noise")
        self.optimizer: torch.optim.Optimizer = self._create_optimizer()
        self.compiled_step = self._compiled_step(grad_scaler)
        self.set_learning_rate(self.learning_rate)

    def _compiled_step(self, grad_scaler: bool) -> OptimizerStep | None:
        """RETURNN's ``torch_optimizer_step`` (its limits checked), or None: the optimizer steps eagerly."""
        opts = OptimizerStepOptions.read(self.config.typed_value("torch_optimizer_step"))
        if opts is None:
            return None
        graph = self.config.typed_value("torch_cuda_graph")
        runner = OptimizerStep(self.optimizer, opts)
        opts.check_setting(device=runner.device, grad_scaler=grad_scaler,
                           capture_optimizer=isinstance(graph, dict) and bool(graph.get("capture_optimizer")))
        return runner

    # ---- construction -------------------------------------------------------------------

    def _optimizer_opts(self) -> dict[str, Any]:
        spec = self.config.typed_value("optimizer")
        if spec is None:
            raise ConfigError(
                "config key 'optimizer' is not set; training needs it, e.g. optimizer={'class': 'adamw'} "
                "(the learning rate goes into 'learning_rate')"
            )
        if isinstance(spec, dict):
            opts = dict(spec)
        elif callable(spec):
            opts = {"class": spec}
        else:
            raise ConfigError(
                f"config key 'optimizer': got {spec!r}, expected a dict {{'class': 'adamw', ...}}, a class or a factory"
            )
        problems = []
        if "class" not in opts:
            problems.append("config key 'optimizer': the dict needs a 'class' entry, e.g. {'class': 'adamw'}")
        for bad in ("lr", "learning_rate"):
            if bad in opts:
                problems.append(
                    f"config key 'optimizer': no {bad!r} inside 'optimizer'; set the config key 'learning_rate' instead"
                )
        for name in _GROUPING_OPTS:
            if name in opts and self.config.has(name):
                problems.append(f"'{name}' is set both inside 'optimizer' and as a config key; set it once")
        if problems:
            raise ConfigError(problems)
        for name in _GROUPING_OPTS:
            if name not in opts and self.config.has(name):
                opts[name] = self.config.typed_value(name)
        return opts

    def _create_optimizer(self) -> torch.optim.Optimizer:
        check_optimizer(self.config)  # keywords and their types, as one ConfigError
        opts = self._optimizer_opts()
        cls = resolve_optimizer_class(opts.pop("class"))
        multiplier = float(opts.pop("learning_rate_multiplier", 1.0))
        grouping = {name: opts.pop(name, None) for name in _GROUPING_OPTS}
        accepted = keyword_names(cls) if isinstance(cls, type) else None
        if "epsilon" in opts:
            if "eps" in opts:
                raise ConfigError("config key 'optimizer': set 'eps' or its alias 'epsilon', not both")
            if accepted is None or "eps" in accepted:
                opts["eps"] = opts.pop("epsilon")
        groups = self._param_groups(cls, opts, **grouping)
        for group in groups:
            group["learning_rate_multiplier"] = float(group.get("learning_rate_multiplier", 1.0)) * multiplier
            group["lr"] = self.learning_rate * group["learning_rate_multiplier"]
        try:
            optimizer = cls(groups, lr=self.learning_rate * multiplier, **opts)  # type: ignore[call-arg]  # cls: a subclass
        except (TypeError, ValueError) as e:  # torch's own range checks, e.g. "Invalid beta parameter"
            raise ConfigError(f"config key 'optimizer': {getattr(cls, '__name__', cls)} refused {opts}: {e}") from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"config key 'optimizer': the factory returned {type(optimizer).__name__}, not an Optimizer"
            )
        return optimizer

    def _param_groups(
        self,
        cls: Any,
        opts: dict[str, Any],
        *,
        weight_decay_modules_blacklist: Iterable[Any] | None,
        weight_decay_custom_include_check: Callable[..., bool | None] | None,
        param_groups_custom: Callable[..., list[dict[str, Any]]] | None,
    ) -> list[dict[str, Any]]:
        if param_groups_custom is not None:
            # as RETURNN: the function gets the optimizer's keywords (lr included) and may take its own options out
            # of them (e.g. learning_rate_multipliers_by_patterns); what it leaves goes to the optimizer
            opts["lr"] = self.learning_rate
            groups = param_groups_custom(model=self.model, rf_model=_rf_module(self.model), optimizer_class=cls,
                                         optimizer_opts=opts)
            opts.pop("lr", None)
            if isinstance(cls, type) and (left := keyword_problems(cls, opts)):
                raise ConfigError([f"{p} (param_groups_custom left it in the optimizer options)" for p in left])
            groups = list(groups) if isinstance(groups, Iterable) and not isinstance(groups, (str, dict)) else None
            if not groups or not all(isinstance(g, dict) and "params" in g for g in groups):
                raise ConfigError(
                    "param_groups_custom must return a non-empty list (or other iterable) of dicts, "
                    "each with a 'params' entry"
                )
            return [dict(g, params=list(g["params"])) for g in groups]
        if not opts.get("weight_decay"):
            return [{"params": list(self.model.parameters())}]
        blacklist = (
            default_weight_decay_blacklist()
            if weight_decay_modules_blacklist is None
            else _blacklist_types(weight_decay_modules_blacklist)
        )
        decay, no_decay = self._split_weight_decay(blacklist, weight_decay_custom_include_check)
        return [{"params": decay, "weight_decay": opts["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]

    def _split_weight_decay(
        self, blacklist: tuple[type, ...], include_check: Callable[..., bool | None] | None
    ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        decay: dict[str, torch.nn.Parameter] = {}
        no_decay: dict[str, torch.nn.Parameter] = {}
        seen: set[int] = set()  # shared parameters appear under several modules: each goes in once
        for module_name, module in self.model.named_modules():
            for local_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                full_name = f"{module_name}.{local_name}" if module_name else local_name
                include = None
                if include_check is not None:
                    # RETURNN's arguments, with its value for full_param_name: the name inside the module
                    include = include_check(module=module, rf_module=_rf_module(module),
                                            full_param_name=local_name, param=param)
                    if include is not None and not isinstance(include, bool):
                        raise ConfigError(
                            f"weight_decay_custom_include_check returned {include!r} for {full_name!r}; expected True, False or None"
                        )
                if include is None:  # RETURNN's rule; a blacklist may name rf module types too
                    rf_module = _rf_module(module)
                    include = not (local_name.endswith("bias") or isinstance(module, blacklist)
                                   or (rf_module is not None and isinstance(rf_module, blacklist)))
                (decay if include else no_decay)[full_name] = param
        # RETURNN sorts each group by parameter name (the optimizer state's order follows it)
        return [decay[n] for n in sorted(decay)], [no_decay[n] for n in sorted(no_decay)]

    # ---- learning rate ------------------------------------------------------------------

    def set_learning_rate(self, lr: float) -> None:
        """Set every group's lr to ``lr × learning_rate_multiplier`` (Python floats, no tensors)."""
        self.learning_rate = float(lr)
        lrs = [self.learning_rate * group.get("learning_rate_multiplier", 1.0) for group in self.optimizer.param_groups]
        if self.compiled_step is not None:  # device tensors a graph reads: written in place
            self.compiled_step.set_learning_rates(lrs)
            return
        for group, group_lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = group_lr

    # ---- gradients ----------------------------------------------------------------------

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _grads(self) -> list[torch.nn.Parameter]:
        """The parameters with a gradient in the model's order (``model.parameters()``), as RETURNN noises and
        clips them: a global norm summed in another order (the optimizer's groups) differs in the last bits."""
        return [p for p in self.model.parameters() if p.grad is not None]

    def apply_gradient_noise(self) -> None:
        """Add truncated-normal noise (config ``gradient_noise`` = stddev) to each gradient; no-op if unset."""
        std = self._grad_noise
        if not std:
            return
        with torch.no_grad():
            for param in self._grads():
                grad = param.grad
                if grad is not None:
                    grad.add_(truncated_normal_like(grad, std))

    @property
    def clip_returns_raw_norm(self) -> bool:
        """:meth:`clip_gradients` returns the 2-norm of the gradients as they came: norm clipping is set and
        neither noise nor value clipping changes them before (RETURNN reuses that norm for ``log_grad_norm``)."""
        return bool(self._grad_clip_norm) and not self._grad_noise and not self._grad_clip

    def clip_gradients(self, need_grad_norm: bool = False) -> torch.Tensor | None:
        """Clip by value (``gradient_clip``), then by global norm (``gradient_clip_global_norm``).

        Returns the total gradient norm *before* norm clipping as a device tensor when norm clipping
        is configured or ``need_grad_norm`` is True, else None. Never synchronizes.
        """
        if not (self._grad_clip or self._grad_clip_norm or need_grad_norm):
            return None  # nothing to do: skip collecting the gradients (host time every step)
        params = self._grads()
        if self._grad_clip:
            torch.nn.utils.clip_grad_value_(params, self._grad_clip)
        if self._grad_clip_norm:
            return torch.nn.utils.clip_grad_norm_(params, self._grad_clip_norm)
        if need_grad_norm:
            return total_grad_norm(params)
        return None

    def step(self, *, grad_scaler: Any = None, need_grad_norm: bool = False) -> torch.Tensor | None:
        """Unscale (AMP), add noise, clip, and step the optimizer; returns the grad norm (see clip_gradients)."""
        if grad_scaler is not None:
            grad_scaler.unscale_(self.optimizer)
        self.apply_gradient_noise()
        norm = self.clip_gradients(need_grad_norm=need_grad_norm)
        if grad_scaler is not None:
            grad_scaler.step(self.optimizer)
            grad_scaler.update()
        else:
            self.optimizer_step()
        return norm

    def optimizer_step(self) -> None:
        """``optimizer.step()``, or its compiled / captured form (``torch_optimizer_step``)."""
        if self.compiled_step is not None:
            self.compiled_step.step()
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        """Every gradient to None (a new accumulation window); zeroed in place instead under
        ``torch_optimizer_step`` (a captured step reads them where they are)."""
        self.optimizer.zero_grad(set_to_none=self.compiled_step is None)

    # ---- state --------------------------------------------------------------------------

    def param_names(self) -> list[str]:
        """Names of the optimizer's parameters in optimizer order (saved with the state)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(self.parameters())]

    def state_dict(self) -> dict[str, Any]:
        optimizer = self.optimizer.state_dict()
        if self.compiled_step is not None:  # RETURNN's checkpoint: Python scalars for lrs and counters
            optimizer = self.compiled_step.host_state_dict(optimizer)
        return {
            "optimizer": optimizer,
            "optimizer_class": type(self.optimizer).__qualname__,
            "learning_rate": self.learning_rate,
            "param_names": self.param_names(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        opt_state = state["optimizer"]
        saved_groups = opt_state.get("param_groups", [])
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise KitError(
                f"optimizer state has {len(saved_groups)} parameter groups, the current optimizer has "
                f"{len(self.optimizer.param_groups)} (did weight_decay or param_groups_custom change?)"
            )
        saved_names, names = state.get("param_names"), self.param_names()
        if saved_names is not None and list(saved_names) != names:
            missing = sorted(set(names) - set(saved_names))
            extra = sorted(set(saved_names) - set(names))
            raise KitError(
                "optimizer state does not match the model's parameters: "
                f"not in the state: {missing or 'none'}; not in the model: {extra or 'none'}"
                + ("" if missing or extra else "; same names in another order or grouping")
            )
        self.optimizer.load_state_dict(opt_state)
        if self.compiled_step is not None:  # new state tensors (and Python scalars again)
            self.compiled_step.invalidate()
        self.learning_rate = float(state.get("learning_rate", self.learning_rate))


def _rf_module(module: torch.nn.Module) -> Any:
    """RETURNN's rf module behind a converted torch module (None without RETURNN or for plain modules)."""
    if "returnn" not in sys.modules:
        return None
    try:
        from returnn.torch.frontend.bridge import wrapped_pt_module_to_rf_module  # type: ignore[import]
    except ImportError:
        return None
    return wrapped_pt_module_to_rf_module(module)


def truncated_normal_like(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Normal noise truncated to ±2 std, by the inverse CDF.

    Not ``torch.nn.init.trunc_normal_``: it rejection-samples and reads ``mask.any()`` back to the host.
    """
    lo, hi = (1.0 + math.erf(-2.0 / math.sqrt(2.0))) / 2.0, (1.0 + math.erf(2.0 / math.sqrt(2.0))) / 2.0
    noise = torch.empty_like(tensor).uniform_(2 * lo - 1, 2 * hi - 1)
    noise.erfinv_().mul_(std * math.sqrt(2.0))
    return noise.clamp_(-2 * std, 2 * std)


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients, as a device tensor (no sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g.detach(), 2.0) for g in grads]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def _blacklist_types(items: Iterable[Any]) -> tuple[type, ...]:
    if isinstance(items, (str, type)) or not isinstance(items, Iterable):
        raise ConfigError(
            f"weight_decay_modules_blacklist: got {items!r}, expected a list of module types or dotted names"
        )
    types = []
    for item in items:
        mod = resolve_dotted(item, "weight_decay_modules_blacklist") if isinstance(item, str) else item
        if not (isinstance(mod, type) and (issubclass(mod, torch.nn.Module) or _is_rf_module_type(mod))):
            raise ConfigError(f"weight_decay_modules_blacklist: {item!r} is not a torch.nn.Module subclass")
        types.append(mod)
    return tuple(types)


def _is_rf_module_type(cls: type) -> bool:
    """Whether ``cls`` is a RETURNN frontend module type (RETURNN's blacklist accepts those too)."""
    rf = sys.modules.get("returnn.frontend")
    base = getattr(rf, "Module", None) if rf is not None and not getattr(rf, "KIT_FALLBACK", False) else None
    return isinstance(base, type) and issubclass(cls, base)


def _clip_norm_setting(config: Config) -> float | None:
    main, alias = config.float("gradient_clip_global_norm"), config.float("gradient_clip_norm")
    if main is not None and alias is not None and main != alias:
        raise ConfigError(
            f"'gradient_clip_global_norm' ({main}) and its alias 'gradient_clip_norm' ({alias}) disagree; set one"
        )
    return main if main is not None else alias
