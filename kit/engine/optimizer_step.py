"""RETURNN's ``torch_optimizer_step``: the unchanged ``optimizer.step()`` compiled by Inductor and/or captured
as a CUDA graph that every later update replays — separately from the forward and backward, so it works
where something (gradient clipping, a distributed reduce) runs between the gradients and the update.

>>> torch_optimizer_step = {"compile": True, "capture": False}   # Inductor, no graph (a CPU too)
>>> torch_optimizer_step = {"dynamic_state_keys": ["step"]}        # a custom optimizer's Python-int counter

Each call of :meth:`OptimizerStep.step` is one real update, in phases: the first runs eagerly (the
optimizer creates its lazy state), the second compiled (``compile``; compiling is a few seconds), the
third is captured and replayed at once (``capture``), and every later one is a replay. What a graph would
freeze as a constant is a 0-d device tensor updated in place instead: each group's ``lr`` (the LR schedule
writes into it) and the Python-scalar optimizer state named in ``dynamic_state_keys`` (any other Python
scalar in the state is an error). The optimizer's state dict (checkpoints) keeps RETURNN's Python scalars
(:meth:`OptimizerStep.host_state_dict`). When a parameter, gradient, lr or state tensor is replaced (a loaded
optimizer state, gradients set to None) the next update runs outside a graph and the one after captures
again; the gradients are zeroed in place while this is on. Limits, as in RETURNN: one device, no float16
GradScaler, not with ``torch_cuda_graph``'s ``capture_optimizer``; ``capture`` needs CUDA.

kit compiles with ``torch.compile`` (RETURNN traces with AOT autograd instead): torch's own optimizers read
their step counters on the host outside a compiler, which only Dynamo's trace avoids.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kit.errors import ConfigError

logger = logging.getLogger("kit")

KEY = "torch_optimizer_step"
_KNOWN = ("compile", "capture", "dynamic_state_keys")


@dataclass(frozen=True)
class OptimizerStepOptions:
    """The ``torch_optimizer_step`` dict, checked (RETURNN's option names and defaults)."""

    compile: bool = True
    capture: bool = True
    dynamic_state_keys: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: Any) -> OptimizerStepOptions:
        """The options of one value; a :class:`ConfigError` naming the key and the bad option."""
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{KEY}': got {type(value).__name__}, expected a dict")
        unknown = sorted(map(str, set(value) - set(_KNOWN)))
        if unknown:
            raise ConfigError(f"config key '{KEY}': unknown option(s) {unknown}; known: {', '.join(_KNOWN)}")
        for flag in ("compile", "capture"):
            if not isinstance(value.get(flag, True), bool):
                raise ConfigError(f"config key '{KEY}': '{flag}' must be True or False, got {value[flag]!r}")
        keys = value.get("dynamic_state_keys", ())
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"config key '{KEY}': 'dynamic_state_keys' must be a list of state names (str), "
                              f"got {keys!r}")
        return cls(value.get("compile", True), value.get("capture", True), tuple(keys))

    @classmethod
    def read(cls, value: Any) -> OptimizerStepOptions | None:
        return None if value is None else cls.parse(value)

    def check_setting(self, *, device: torch.device, grad_scaler: bool, capture_optimizer: bool) -> None:
        """RETURNN's limits, as :class:`ConfigError` naming the key."""
        if self.capture and device.type != "cuda":
            raise ConfigError(f"config key '{KEY}': 'capture' records a CUDA graph and needs a CUDA device; this "
                              f"run's device is {device} (use {{'compile': True, 'capture': False}} for the "
                              "Inductor-compiled optimizer step without a graph)")
        if grad_scaler:
            raise ConfigError(f"config key '{KEY}': a float16 GradScaler is not supported (as in RETURNN); use "
                              "torch_amp='bfloat16' or grad_scaler=False")
        if capture_optimizer:
            raise ConfigError(f"config key '{KEY}': not together with torch_cuda_graph's 'capture_optimizer' "
                              "(both put the optimizer step into a graph); set one")


def _step_template(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


class OptimizerStep:
    """Runs ``optimizer.step()`` eagerly, then compiled, then as a replayed CUDA graph (module docstring).

    ``eager_steps``, ``compiled_steps``, ``replays``, ``compiles`` and ``captures`` count what ran.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, opts: OptimizerStepOptions):
        devices = {p.device for g in optimizer.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ConfigError(f"config key '{KEY}': the optimizer's parameters must be on one device, "
                              f"they are on {sorted(map(str, devices))}")
        self.optimizer, self.opts = optimizer, opts
        (self.device,) = devices
        self.eager_steps = self.compiled_steps = self.replays = self.compiles = self.captures = 0
        self._compiled: Callable[[torch.optim.Optimizer], None] | None = None
        self._warm = False  # the current compiled function (or, without compile, the eager step) ran once
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_inputs: list[torch.Tensor] = []  # kept alive: the graph reads and writes their memory
        self._lrs: list[torch.Tensor] = []  # the device lrs this made (a checkpoint holds floats for them)
        self._state_types: dict[str, type] = {}  # dynamic_state_keys made device scalars: their Python type

    # ---- the update -------------------------------------------------------------------------

    def step(self) -> None:
        """One update, like ``optimizer.step()``."""
        if self._graph is not None:
            if _addresses(self._inputs()) == _addresses(self._graph_inputs):
                self._graph.replay()
                self.replays += 1
                return
            logger.info("%s: parameters, gradients or optimizer state were replaced; capturing again", KEY)
            self._graph, self._graph_inputs, self._warm = None, [], False  # a warm run first (a recompile if any)
        if self.eager_steps == 0:
            self._eager()  # creates the optimizer's lazy state
            return
        self._make_dynamic()
        if self._warm and self.opts.capture:
            self._capture()
        elif self.opts.compile:
            self._run_compiled()
        else:
            self._eager()
        self._warm = True

    def _eager(self) -> None:
        with _TensorScalarArgs():
            self.optimizer.step()
        self.eager_steps += 1

    def _run_compiled(self) -> None:
        if self._compiled is None:
            self._compiled = self._compile()
        with _TensorScalarArgs():
            self._compiled(self.optimizer)
        self.compiled_steps += 1

    def _compile(self) -> Callable[[torch.optim.Optimizer], None]:
        """A fresh function for ``torch.compile`` (its own code object: its own cache, so old optimizers and
        states never use up the recompile limit of a shared one)."""
        self.compiles += 1
        logger.info("%s: compiling the optimizer step (compile %d)", KEY, self.compiles)
        code = _step_template.__code__.replace(co_name=f"optimizer_step_{id(self):x}_{self.compiles}")
        fn = types.FunctionType(code, _step_template.__globals__, code.co_name)
        return torch.compile(fn, dynamic=False)  # type: ignore[return-value]  # torch.compile's typing

    def _capture(self) -> None:
        """Record the (compiled) step as a CUDA graph, then replay it: the capture itself only records."""
        inputs = self._inputs()
        for name, t in self._named_state_tensors():
            if t.device != self.device:
                raise ConfigError(f"config key '{KEY}': optimizer state {name!r} is on {t.device}, not on "
                                  f"{self.device}: a graph would never update it (torch's optimizers: set "
                                  "'capturable': True in config key 'optimizer')")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), _TensorScalarArgs():
            if self.opts.compile:
                assert self._compiled is not None
                self._compiled(self.optimizer)
            else:
                self.optimizer.step()
        self._graph, self._graph_inputs = graph, inputs
        self.captures += 1
        logger.info("%s: captured the optimizer step (capture %d)", KEY, self.captures)
        graph.replay()
        self.replays += 1

    def invalidate(self) -> None:
        """Drop the captured graph and the compiled function (e.g. the optimizer state was loaded): the next
        update compiles (when asked) and captures again."""
        self._graph, self._graph_inputs = None, []
        self._compiled, self._warm = None, False
        self._lrs = [g["lr"] for g in self.optimizer.param_groups if any(g["lr"] is lr for lr in self._lrs)]

    # ---- what a graph would freeze ---------------------------------------------------------

    def _make_dynamic(self) -> None:
        """Each group's lr and the ``dynamic_state_keys`` scalars to device tensors, in the optimizer."""
        for group in self.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = self._device_scalar(float(group["lr"]))
                self._lrs.append(group["lr"])
        for state in self.optimizer.state.values():
            for k, v in list(state.items()):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                if k not in self.opts.dynamic_state_keys:
                    raise ConfigError(
                        f"config key '{KEY}': the optimizer state {k!r} is a Python {type(v).__name__} ({v!r}); "
                        f"compiled or captured it would stay constant. Add {k!r} to 'dynamic_state_keys' (now "
                        f"{list(self.opts.dynamic_state_keys)}) to keep it as a device tensor")
                self._state_types[k] = type(v)  # an optimizer may rebind it (``s["step"] = s["step"] + 1``)
                state[k] = self._device_scalar(v)

    def _device_scalar(self, value: int | float) -> torch.Tensor:
        dtype = torch.int64 if isinstance(value, int) else torch.float32
        return torch.tensor(value, dtype=dtype, device=self.device)

    def set_learning_rates(self, lrs: list[float]) -> None:
        """The schedule's lr per group: written into the device tensors (no new tensor, no graph input)."""
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def host_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.state_dict()`` with Python scalars again where this made device tensors (a copy; the
        optimizer's own dicts are not touched). One device read for all of them."""
        groups = [dict(g) for g in state_dict["param_groups"]]
        states = {i: dict(s) for i, s in state_dict["state"].items()}
        places: list[tuple[dict[str, Any], str, type]] = [
            (g, "lr", float) for g in groups if any(g["lr"] is mine for mine in self._lrs)]
        for s in states.values():
            for k, v in s.items():
                kind = self._state_types.get(k)
                if kind is not None and isinstance(v, torch.Tensor) and v.dim() == 0:
                    places.append((s, k, kind))
        if places:
            values = torch.stack([d[k].to(torch.float64) for d, k, _ in places]).tolist()
            for (d, k, kind), value in zip(places, values):
                d[k] = kind(round(value)) if kind is int else kind(value)
        return {**state_dict, "param_groups": groups, "state": states}

    # ---- what the graph reads --------------------------------------------------------------

    def _named_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    yield k, v

    def _inputs(self) -> list[torch.Tensor]:
        """Everything the captured step reads or writes: lrs, parameters, gradients, state tensors."""
        found: list[torch.Tensor] = []
        for group in self.optimizer.param_groups:
            found.append(group["lr"])
            for p in group["params"]:
                if p.grad is not None:
                    found += [p, p.grad]
        found += [t for _, t in self._named_state_tensors()]
        return found


def _addresses(tensors: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() if isinstance(t, torch.Tensor) else id(t) for t in tensors]


class _TensorScalarArgs(TorchFunctionMode):
    """A tensor ``alpha`` / ``value`` (an optimizer written for a float lr: ``p.add_(u, alpha=-lr)``) as an
    explicit product: torch would read the tensor back to the host (no graph can hold that)."""

    _ALPHA = frozenset({"add", "add_", "sub", "sub_"})
    _VALUE: dict[str, Callable[..., torch.Tensor]] = {"addcmul": torch.mul, "addcmul_": torch.mul, "addcdiv": torch.div, "addcdiv_": torch.div}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in self._ALPHA and isinstance(kwargs.get("alpha"), torch.Tensor):
            alpha = kwargs.pop("alpha")
            args = (args[0], args[1] * alpha, *args[2:])
        elif name in self._VALUE and isinstance(kwargs.get("value"), torch.Tensor) and len(args) >= 3:
            value = kwargs.pop("value")
            update = self._VALUE[name](args[1], args[2]) * value
            func = torch.Tensor.add_ if name.endswith("_") else torch.Tensor.add
            args = (args[0], update, *args[3:])
        return func(*args, **kwargs)
