"""RETURNN's ``torch_cuda_graph``: the train step at bound shapes, Inductor-compiled and/or captured as one
CUDA graph that each later step replays.

What runs once per step is the same box as :func:`kit.engine.step.train_step` (the guard's check, the
update, the accounting); only the forward and backward (and with ``capture_optimizer`` the update) run
differently: the batch is copied into static buffers padded to ``batch_size_bound`` sequences and
``dim_capacity`` frames (padding sequences have length 0), and the step on those buffers is

* ``capture`` (CUDA only): recorded once as a CUDA graph (after a few warm runs whose effects on the
  module buffers and the RNG are put back) and replayed for every later step;
* ``compile``: traced and compiled by Inductor (``torch.compile``; on a CPU as well), and with
  ``capture`` the compiled step is what is captured.

The first ``warmup_steps`` steps run eagerly, as does every step that the non-finite guard trains again
in immediate mode after a rewind. Loss values, the gradients and the gradient norm are handed on as
copies or rebound after each replay, so nothing that reads them later sees a later step's values. The
engine calls this object instead of :func:`~kit.engine.step.train_step` (``Engine._step_options``);
the loop around the step (events, pause, interrupts, break points) is the same.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kit.config import Config
from kit.data.batch import Batch, Field
from kit.engine import step as eager
from kit.engine.accounting import StepLosses, stack_losses
from kit.engine.compute import total_loss
from kit.errors import ConfigError, DataError
from kit.rng import RngState
from kit.run_ctx import RunCtx

if TYPE_CHECKING:
    from kit.engine.parts import Built, Training
    from kit.engine.progress import Progress
    from kit.engine.step import StepOptions, StepResult

logger = logging.getLogger("kit")

KEY = "torch_cuda_graph"
_KNOWN = ("batch_size_bound", "dim_capacity", "mask_padding_seqs", "warmup_steps", "capture_optimizer", "compile",
          "capture")
# RETURNN's options of its own AOT/Inductor pipeline (packed batches, partitioned compile, debug dumps): kit
# compiles with torch.compile instead, where these have no counterpart; named in one warning
_RETURNN_ONLY = ("packed_total_bound", "partitioned", "activation_memory_budget", "aggressive_recomputation",
                 "inductor_nan_asserts", "dump_fx_dir", "dump_memory_snapshot", "debug_nan_dump_inputs",
                 "debug_zero_init_buffers", "debug_nan_report", "inductor_conservative", "debug_aot_eager",
                 "debug_eager_bound", "debug_dump_buffer_names")
_WARM_RUNS = 3  # side-stream runs before a capture (torch's recipe: lazy kernels and workspaces set up)


@dataclass(frozen=True)
class GraphOptions:
    """The ``torch_cuda_graph`` dict, checked (RETURNN's option names and defaults)."""

    batch_size_bound: int
    dim_capacity: Mapping[str, int] = field(default_factory=dict)
    mask_padding_seqs: bool = True  # the step can tell padding sequences: ``extern_data.seq_mask()``
    warmup_steps: int = 0
    capture_optimizer: bool = False
    compile: bool = False
    capture: bool = True

    @classmethod
    def parse(cls, value: Any) -> GraphOptions:
        """The options of one ``torch_cuda_graph`` value; a :class:`ConfigError` naming what is wrong."""
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{KEY}': got {type(value).__name__}, expected a dict")
        unknown = sorted(set(value) - set(_KNOWN) - set(_RETURNN_ONLY))
        if unknown:
            raise ConfigError(f"config key '{KEY}': unknown option(s) {unknown}; known: {', '.join(_KNOWN)}")
        ignored = sorted(set(value) & set(_RETURNN_ONLY))
        if ignored:
            logger.warning("config key '%s': RETURNN's option(s) %s of its own compile pipeline are ignored by kit",
                           KEY, ignored)
        bound, caps = value.get("batch_size_bound"), value.get("dim_capacity", {})
        if not _positive_int(bound):
            raise ConfigError(f"config key '{KEY}': 'batch_size_bound' must be a positive int, got {bound!r}")
        if not isinstance(caps, Mapping) or not all(isinstance(k, str) and _positive_int(v) for k, v in caps.items()):
            raise ConfigError(f"config key '{KEY}': 'dim_capacity' must map data keys to positive ints, got {caps!r}")
        warmup = value.get("warmup_steps", 0)
        if not (_positive_int(warmup) or warmup == 0):
            raise ConfigError(f"config key '{KEY}': 'warmup_steps' must be an int >= 0, got {warmup!r}")
        flags = {k: value.get(k, d) for k, d in (("mask_padding_seqs", True), ("capture_optimizer", False),
                                                 ("compile", False), ("capture", True))}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise ConfigError(f"config key '{KEY}': '{k}' must be True or False, got {v!r}")
        if not flags["capture"] and not flags["compile"]:
            raise ConfigError(f"config key '{KEY}': 'capture': False requires 'compile': True (as in RETURNN)")
        if flags["capture_optimizer"] and not flags["capture"]:
            raise ConfigError(f"config key '{KEY}': 'capture_optimizer' needs 'capture': True")
        return cls(bound, dict(caps), warmup_steps=warmup, **flags)  # type: ignore[arg-type]  # checked above

    @classmethod
    def read(cls, config: Config) -> GraphOptions | None:
        value = config.typed_value(KEY)
        return None if value is None else cls.parse(value)

    def check_setting(self, *, device: torch.device, accum: Any, grad_scaler: bool, distributed: bool) -> None:
        """RETURNN's limits of the whole-step graph, as :class:`ConfigError` naming the key."""
        if self.capture and device.type != "cuda":
            raise ConfigError(f"config key '{KEY}': 'capture' records a CUDA graph and needs a CUDA device; "
                              f"this run's device is {device} (use {{'compile': True, 'capture': False, ...}} "
                              "for the Inductor-compiled step without a graph)")
        if accum != 1:
            raise ConfigError(f"config key '{KEY}': gradient accumulation is not supported "
                              f"(accum_grad_multiple_step={accum!r}; as in RETURNN it must be 1)")
        if grad_scaler:
            raise ConfigError(f"config key '{KEY}': a float16 GradScaler is not supported (as in RETURNN); "
                              "use torch_amp='bfloat16' or grad_scaler=False")
        if distributed:
            raise ConfigError(f"config key '{KEY}': torch_distributed is not supported by kit's graphed step")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# ---- the static inputs ------------------------------------------------------------------------


class BoundBatch(Batch):
    """The batch the graphed step sees: every field padded to ``batch_size_bound`` sequences (padding
    sequences have length 0) and its time axis to ``dim_capacity``; lengths live on the step's device."""

    def __init__(self, fields: dict[str, Field], num_seqs: torch.Tensor, mask_padding_seqs: bool, source: Batch):
        bound = next(iter(fields.values())).tensor.shape[0]
        super().__init__(fields, seq_tags=[""] * bound, epoch=source.epoch, complete_frac=source.complete_frac,
                         batch_idx=source.batch_idx)
        self.num_real_seqs = num_seqs  # 0-d int64 on the device: the real batch's number of sequences
        self._mask_padding_seqs = mask_padding_seqs

    def seq_mask(self) -> torch.Tensor:
        """Bool ``[batch_size_bound]``: True for the real sequences (all True with ``mask_padding_seqs=False``,
        where, as in RETURNN, padding sequences cannot be told from empty ones)."""
        bound = self.num_seqs
        device = self.num_real_seqs.device
        if not self._mask_padding_seqs:
            return torch.ones(bound, dtype=torch.bool, device=device)
        return torch.arange(bound, device=device) < self.num_real_seqs


class StaticInputs:
    """One buffer per data key at the bounds (and a device lengths buffer per time-axis key); each step's
    batch is copied in (what is left of a larger earlier batch is zeroed)."""

    def __init__(self, opts: GraphOptions, device: torch.device):
        self.opts, self.device = opts, device
        self.data: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, torch.Tensor] = {}
        self.sparse: dict[str, int | None] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.num_seqs = torch.zeros((), dtype=torch.int64, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)

    def copy_in(self, batch: Batch, global_train_step: int) -> None:
        n, bound = batch.num_seqs or _rows(batch), self.opts.batch_size_bound
        if n > bound:
            raise DataError(f"config key '{KEY}': a batch of {n} sequences exceeds batch_size_bound={bound} "
                            "(raise it, or lower max_seqs)")
        for key, f in batch.fields.items():
            buf = self.data[key] if key in self.data else self._make(key, f)
            shape = tuple(f.tensor.shape)
            if f.lengths is not None and shape[1] > buf.shape[1]:
                raise DataError(f"config key '{KEY}': a sequence of {shape[1]} frames in data key {key!r} exceeds "
                                f"dim_capacity[{key!r}]={buf.shape[1]} (raise it, or set max_seq_length)")
            if len(shape) != buf.dim() or any(s > b for s, b in zip(shape, buf.shape)):
                raise DataError(f"config key '{KEY}': data key {key!r} of shape {shape} does not fit the bounds "
                                f"{tuple(buf.shape)}")
            if any(s < p for s, p in zip(shape, self.shapes.get(key, shape))):
                buf.zero_()  # stale frames of a larger batch never stay behind the padding
            self.shapes[key] = shape
            buf[tuple(slice(0, s) for s in shape)].copy_(f.tensor, non_blocking=True)
            if f.lengths is not None:
                lengths = torch.zeros(bound, dtype=torch.int32)
                lengths[:n] = f.lengths
                self.lengths[key].copy_(lengths, non_blocking=True)
        self.num_seqs.fill_(n)
        self.step.fill_(global_train_step)

    def _make(self, key: str, f: Field) -> torch.Tensor:
        shape = [self.opts.batch_size_bound, *f.tensor.shape[1:]]
        if f.lengths is not None:
            cap = self.opts.dim_capacity.get(key)
            if cap is None:
                raise ConfigError(f"config key '{KEY}': 'dim_capacity' needs an entry for data key {key!r} "
                                  "(it has a time axis)")
            shape[1] = cap
            self.lengths[key] = torch.zeros(self.opts.batch_size_bound, dtype=torch.int32, device=self.device)
        self.data[key] = torch.zeros(shape, dtype=f.tensor.dtype, device=self.device)
        self.sparse[key] = f.sparse_dim
        return self.data[key]

    def batch(self, source: Batch) -> BoundBatch:
        fields = {k: Field(buf, self.lengths.get(k), self.sparse[k]) for k, buf in self.data.items()}
        return BoundBatch(fields, self.num_seqs, self.opts.mask_padding_seqs, source)


def _rows(batch: Batch) -> int:
    return next(iter(batch.fields.values())).tensor.shape[0] if batch.fields else 0


# ---- the graphed step ---------------------------------------------------------------------------


@dataclass
class _Outputs:
    """What one run of the bound step leaves: the losses (device scalars), the total and the grad norm."""

    losses: StepLosses
    grad_norm: torch.Tensor | None = None

    def copied(self) -> tuple[StepLosses, torch.Tensor | None]:
        """Copies on the device (no sync): a replay overwrites the originals in place."""
        s = self.losses
        losses = StepLosses(list(s.names), [t.clone() for t in s.sums], [t.clone() for t in s.norms], s.errors)
        return losses, None if self.grad_norm is None else self.grad_norm.clone()


class GraphedStep:
    """The engine's train step under ``torch_cuda_graph`` (see the module's docstring)."""

    def __init__(self, opts: GraphOptions, b: Built, t: Training):
        self.opts = opts
        self.inputs = StaticInputs(opts, b.device)
        self.eager_left = opts.warmup_steps
        self._graph: torch.cuda.CUDAGraph | None = None
        self._compiled: Callable[..., Any] | None = None
        self._out: _Outputs | None = None
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._lrs: list[torch.Tensor] = []  # capture_optimizer: each param group's lr, a graph input

    @classmethod
    def for_config(cls, config: Config, b: Built, t: Training, *, accum: Any) -> GraphedStep | None:
        """The graphed step the config asks for (its limits checked), or None."""
        opts = GraphOptions.read(config)
        if opts is None:
            return None
        opts.check_setting(device=b.device, accum=accum, grad_scaler=b.compute.grad_scaler is not None,
                           distributed=b.dist is not None)
        optimizer = t.updater.optimizer
        if opts.capture_optimizer and not all("capturable" in g for g in optimizer.param_groups):
            raise ConfigError(f"config key '{KEY}': 'capture_optimizer' needs an optimizer with torch's "
                              f"'capturable' option (Adam, AdamW, ...); {type(optimizer).__name__} has none")
        return cls(opts, b, t)

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def invalidate(self) -> None:
        """The training state was put back (new optimizer-state tensors): the next step captures again."""
        self._graph, self._out, self._grads = None, None, []

    def train_step(self, batch: Batch, started: float, p: Progress, b: Built, t: Training,
                   opts: StepOptions) -> StepResult:
        """One step as :func:`kit.engine.step.train_step`, the forward and backward at the bounds."""
        if self.eager_left > 0 or self._eager_guard(t):
            self.eager_left = max(0, self.eager_left - 1)
            return eager.train_step(batch, started, p, b, t, opts)
        t.last_batch = batch  # a break point and a replay read the real batch (kit.debug replays it eagerly)
        lr = t.schedule.for_step(p, opts.dynamic_learning_rate)
        t.step_rng = RngState.capture(host=False) if opts.keep_rng else None
        self.inputs.copy_in(batch, p.global_train_step)
        t.updater.zero_grad()  # every step is a window (no accumulation); a replay rebinds the graph's
        losses, grad_norm = self._run(b, t, opts, p.epoch)
        p.micro_batch_added()
        finite = t.guard.check(losses, p, batch, t.step_rng)
        updated = finite and p.accum_count >= 1
        if updated and self.opts.capture_optimizer:
            p.update_done()  # the graph's update, for a step the guard let through
        elif updated:
            grad_norm, _ = eager.update(p, b, t)  # (log_grad_norm is not reported for a graphed step)
        t.accounting.add(losses)
        result = eager.StepResult(p.epoch, p.step_in_epoch, p.global_train_step, lr, updated,
                                  time.perf_counter() - started, batch.num_seqs, batch.complete_frac, losses,
                                  grad_norm if updated else None, b.memory.end_step())
        p.step_done(batch.complete_frac)
        return result

    def _eager_guard(self, t: Training) -> bool:
        """With the update in the graph, a step the guard reads at once runs eagerly: the guard must be able
        to keep a bad update from the weights (its deferred mode rewinds instead)."""
        return self.opts.capture_optimizer and t.guard.options.enabled and not t.guard.deferred

    def _run(self, b: Built, t: Training, opts: StepOptions, epoch: int) -> tuple[StepLosses, torch.Tensor | None]:
        """The bound step's losses and grad norm (copies), the gradients bound to the parameters. An error of
        the user's step (while compiling or capturing) is announced as the eager step's is: a break point
        replays the real batch eagerly."""
        try:
            return self._run_bound(b, t, opts, epoch)
        except Exception as exc:
            assert t.last_batch is not None
            b.compute.report_user_error(exc, stage="train", batch=t.last_batch, rng=t.step_rng)
            raise

    def _run_bound(self, b: Built, t: Training, opts: StepOptions, epoch: int) -> tuple[StepLosses,
                                                                                       torch.Tensor | None]:
        if self._graph is not None:
            self._set_lrs(t)
            self._graph.replay()
        elif self.opts.capture:
            self._capture(b, t, opts, epoch)
        else:
            self._out = self._bound_step(b, t, opts, epoch, compiled=True)
            return self._out.copied()  # fresh tensors each call: nothing to copy, nothing to rebind
        for prm, grad in self._grads:
            prm.grad = grad  # the graph writes these; a zero_grad(set_to_none) in between unbound them
        assert self._out is not None
        return self._out.copied()

    def _bound_step(self, b: Built, t: Training, opts: StepOptions, epoch: int, *, compiled: bool,
                    update: bool = False) -> _Outputs:
        """Forward, losses and backward of the batch in the static buffers (compiled when asked)."""
        core = self._core(b, opts, epoch)
        if compiled and self.opts.compile:
            if self._compiled is None:
                self._compiled = torch.compile(core)
            core = self._compiled
        assert t.last_batch is not None
        names, errors, values, total = core(self.inputs.batch(t.last_batch), self.inputs.step)
        total.backward()
        n = len(names)
        losses = StepLosses(names, list(values[:n]), list(values[n:]), errors)
        grad_norm = t.updater.step() if update else None  # capture_optimizer: noise, clipping, optimizer
        return _Outputs(losses, grad_norm)

    def _core(self, b: Built, opts: StepOptions, epoch: int) -> Callable[..., Any]:
        """The user's step at the bounds as one function of the batch: what Inductor compiles. The run
        context's ``step`` is the global step as a device scalar (as in RETURNN: a graph input)."""
        compute, fn = b.compute, opts.train_step

        def core(batch: BoundBatch, step: torch.Tensor) -> tuple[list[str], frozenset[str], list[torch.Tensor],
                                                                  torch.Tensor]:
            ctx = RunCtx("train", train_flag=True, epoch=epoch, step=step)  # type: ignore[arg-type]
            compute.forward(fn, ctx, batch)
            losses = stack_losses(ctx.losses)
            return losses.names, losses.errors, [*losses.sums, *losses.norms], total_loss(ctx)

        return core

    # ---- capture --------------------------------------------------------------------------------

    def _capture(self, b: Built, t: Training, opts: StepOptions, epoch: int) -> None:
        """Warm runs on a side stream (their effects on buffers and RNG put back), then the capture, then
        the first replay: this step."""
        params = [prm for prm in b.model.parameters() if prm.requires_grad]
        side = torch.cuda.Stream(b.device)
        side.wait_stream(torch.cuda.current_stream(b.device))
        with torch.cuda.stream(side), _state_kept(b.model):
            for _ in range(_WARM_RUNS):
                t.updater.zero_grad()
                self._bound_step(b, t, opts, epoch, compiled=True)
        torch.cuda.current_stream(b.device).wait_stream(side)
        if self.opts.capture_optimizer:
            _materialize_optimizer_state(t.updater.optimizer, params)
        t.updater.zero_grad()  # the capture allocates the gradients: the graph's outputs from now on
        graph = torch.cuda.CUDAGraph()
        with self._lr_tensors(t, b.device), torch.cuda.graph(graph):
            self._out = self._bound_step(b, t, opts, epoch, compiled=True, update=self.opts.capture_optimizer)
        self._graph = graph
        self._grads = [(prm, prm.grad) for prm in params if prm.grad is not None]
        self._set_lrs(t)
        graph.replay()
        logger.info("%s: captured the train step (batch_size_bound %d, dim_capacity %s%s)", KEY,
                    self.opts.batch_size_bound, dict(self.opts.dim_capacity),
                    ", compiled" if self.opts.compile else "")

    @contextlib.contextmanager
    def _lr_tensors(self, t: Training, device: torch.device) -> Iterator[None]:
        """capture_optimizer: each group's lr a device tensor while capturing (the schedule's float goes in
        before every replay); the optimizer holds floats again afterwards (its state dict stays RETURNN's)."""
        if not self.opts.capture_optimizer:
            yield
            return
        groups = t.updater.optimizer.param_groups
        floats = [g["lr"] for g in groups]
        self._lrs = [torch.tensor(float(lr), dtype=torch.float32, device=device) for lr in floats]
        for g, lr in zip(groups, self._lrs):
            g["lr"] = lr
        try:
            yield
        finally:
            for g, lr in zip(groups, floats):
                g["lr"] = lr

    def _set_lrs(self, t: Training) -> None:
        for g, lr in zip(t.updater.optimizer.param_groups, self._lrs):
            lr.fill_(float(g["lr"]))


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module) -> Iterator[None]:
    """The warm runs only warm kernels (they never update): module buffers (BatchNorm statistics), parameters
    without gradient and the RNG are put back afterwards (copies on the CPU: no device memory kept)."""
    tensors = [*model.buffers(), *(prm for prm in model.parameters() if not prm.requires_grad)]
    saved = [x.detach().to("cpu", copy=True) for x in tensors]
    rng = RngState.capture(host=False)
    try:
        yield
    finally:
        with torch.no_grad():
            for x, kept in zip(tensors, saved):
                x.copy_(kept)
        rng.restore()


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """A captured optimizer step needs its lazy state (Adam's moments and step) before the capture: one step
    on zero gradients creates it, then the state is zeroed and the weights put back — a fresh state for
    Adam, AdamW and RMSprop. State from eager steps stays; its step counters move to the device."""
    for g in optimizer.param_groups:
        g["capturable"] = True
    if optimizer.state:
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != params[0].device:
                state["step"] = step.to(params[0].device)
        return
    kept = [prm.detach().clone() for prm in params]
    for prm in params:
        prm.grad = torch.zeros_like(prm)
    optimizer.step()
    with torch.no_grad():
        for prm, w in zip(params, kept):
            prm.copy_(w)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
