"""Training on several processes started by ``torchrun``: one process per device, one engine core.

Start it with ``torchrun --nproc_per_node N -m kit train CONFIG`` and set ``torch_distributed``
in the config (RETURNN's key; ``{}`` gives the defaults)::

    torch_distributed = {}                                           # DDP: gradients averaged
    torch_distributed = {"reduce_type": "param", "param_sync_step": 100}  # weights averaged
    torch_distributed = {"options": {"find_unused_parameters": True}}     # DDP keyword arguments

Options: ``reduce_type`` ``"grad"`` (default) or ``"param"``; ``param_sync_step`` (updates
between weight averages, needed for ``"param"``); ``options`` (``DistributedDataParallel``
keyword arguments); ``backend`` (default ``gloo`` on the CPU, ``cpu:gloo,cuda:nccl`` on CUDA).

What each rank does (``W`` processes, ranks ``0 .. W-1``):

- **Device.** ``cuda:LOCAL_RANK`` when the device is CUDA, else the CPU (gloo). MPS cannot.
- **Data.** Every rank plans the same epoch (same seed, same order and batches) and trains on
  batches ``rank, rank + W, rank + 2W, ...`` of it. Every rank runs ``floor(num_batches / W)``
  steps per epoch: the last ``num_batches % W`` batches of each epoch are not trained on.
  (RETURNN instead all-reduces a "has data" flag every step; a fixed count needs no
  collective and no host sync per step, and gives the same result when the shares are even.)
  Evaluation uses every batch: batch ``i`` on rank ``i % W``.
- **Gradients** (``"grad"``). The model is wrapped in ``DistributedDataParallel``; the user's
  ``train_step`` runs inside DDP's forward (its reducer has to see it) and still gets the
  user's own module as ``model``. DDP *averages* the gradients of the ranks (as in RETURNN):
  one update of W ranks equals a single process's ``accum_grad_multiple_step=W`` update
  with the learning rate divided by W. Inside an accumulation window the micro-batches run
  under ``no_sync()``; the window's last micro-batch (and the epoch's last) syncs.
- **Weights** (``"param"``). No DDP: each rank updates alone, and the weights (and float
  buffers) are averaged over the ranks every ``param_sync_step`` updates and at each epoch
  end, so that every rank evaluates and saves the same model.
- **Scores.** Loss sums and norms of all ranks are added at epoch end (train) and after each
  eval dataset, so every rank and the score file hold the global, frame-weighted scores.
  ``epoch_num_train_steps`` in the score meta counts the steps of all ranks together;
  ``global_train_step`` counts each rank's own steps (the same on every rank).
- **Files.** Rank 0 alone writes checkpoints, the score file and cleans up; the other ranks
  wait for each save (and fail too when rank 0's save fails). A checkpoint holds rank 0's
  state and, mid-epoch, the loss sums of all ranks so far. Every rank resumes from the same
  newest checkpoint. Ranks other than 0 log warnings and errors only.
- **Randomness.** Each epoch reseeds from ``(random_seed, epoch, global step, rank)``, so the
  ranks draw different dropout masks (rank 0 draws what a single process would).
- The process group is created by the engine's set-up (or taken over when the caller already
  made one) and destroyed by ``Engine.close()`` when the engine created it.

Not done here: sharded forward (``python -m kit forward`` runs the whole data on every
rank), agreeing across
ranks on a skipped non-finite update when only one rank's reported loss is non-finite, and
bit-exact continuation from a checkpoint saved inside an accumulation window (the open
window's gradients of rank 0 are restored on every rank).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kit.errors import ConfigError, DataError, KitError

if TYPE_CHECKING:
    from kit.config import Config
    from kit.data.dataset import Dataset
    from kit.data.pipeline import Pipeline

logger = logging.getLogger("kit")

OPTIONS = ("reduce_type", "param_sync_step", "options", "backend")
REDUCE_TYPES = ("grad", "param")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---- set-up --------------------------------------------------------------------------------


def from_config(config: Any, device: torch.device) -> DistributedContext | None:
    """The context ``torch_distributed`` asks for, with its process group; None without the key.

    Raises:
        ConfigError: the key is set, but this process was not started by torchrun, or an
            option is wrong.
    """
    options = config.typed_value("torch_distributed")
    if options is None:
        _warn_if_duplicated()
        return None
    reduce_type, sync_step, ddp_options, backend = parse_options(options)
    owns_group = not dist.is_initialized()
    if owns_group:
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise ConfigError(
                f"config key 'torch_distributed' is set, but this process was not started by torchrun "
                f"(no {', '.join(missing)} in the environment): start it with "
                "'torchrun --nproc_per_node N -m kit train CONFIG', or remove 'torch_distributed'"
            )
    rank, world_size = _rank_and_size(owns_group)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _process_device(device, local_rank)
    if owns_group:
        backend = backend or ("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        # Imported before the group exists: its functions' defaults (group=group.WORLD) would keep the
        # group alive past destroy_process_group() (DDP imports it), and gloo threads that outlive
        # close() can abort the process at exit ("terminate called without an active exception").
        import torch.distributed.nn.functional  # noqa: F401

        dist.init_process_group(backend=backend)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistributedContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        reduce_type=reduce_type,
        param_sync_step=sync_step,
        ddp_options=ddp_options,
        owns_group=owns_group,
    )


def parse_options(options: Any) -> tuple[str, int | None, dict[str, Any], str | None]:
    """``(reduce_type, param_sync_step, ddp_options, backend)``; every problem in one ConfigError."""
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"config key 'torch_distributed': got {options!r}, expected a dict ({{}} for the defaults)"
        )
    problems = []
    for name in options:
        if name not in OPTIONS:
            guess = difflib.get_close_matches(str(name), OPTIONS, n=1)
            hint = f" — did you mean {guess[0]!r}?" if guess else f" (known: {', '.join(OPTIONS)})"
            problems.append(f"config key 'torch_distributed': unknown option {name!r}{hint}")
    reduce_type = options.get("reduce_type", "grad")
    if reduce_type not in REDUCE_TYPES:
        problems.append(
            f"config key 'torch_distributed': reduce_type {reduce_type!r}, expected 'grad' or 'param'"
        )
    sync_step = options.get("param_sync_step")
    if reduce_type == "param" and not (
        isinstance(sync_step, int) and not isinstance(sync_step, bool) and sync_step > 0
    ):
        problems.append(
            f"config key 'torch_distributed': reduce_type 'param' needs param_sync_step, a positive "
            f"int (updates between weight averages), got {sync_step!r}"
        )
    if reduce_type == "grad" and sync_step is not None:
        problems.append("config key 'torch_distributed': param_sync_step only applies to reduce_type 'param'")
    ddp_options = options.get("options") or {}
    if not isinstance(ddp_options, Mapping):
        problems.append(
            f"config key 'torch_distributed': options {ddp_options!r}, expected a dict of "
            "DistributedDataParallel keyword arguments"
        )
    backend = options.get("backend")
    if backend is not None and not isinstance(backend, str):
        problems.append(f"config key 'torch_distributed': backend {backend!r}, expected a string like 'gloo'")
    if problems:
        raise ConfigError(problems)
    return reduce_type, sync_step, dict(ddp_options), backend


def _warn_if_duplicated() -> None:
    """RETURNN trains distributed only when the key is set; under torchrun without it, say so."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and rank > 0:
        logger.warning(
            "this process is rank %d of %d (torchrun), but the config does not set 'torch_distributed': it "
            "trains alone, duplicating rank 0's work and writing the same files; set torch_distributed = {} "
            "to train together",
            rank,
            world_size,
        )


def _rank_and_size(owns_group: bool) -> tuple[int, int]:
    if not owns_group:
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _process_device(device: torch.device, local_rank: int) -> torch.device:
    """One process per device: ``cuda`` becomes ``cuda:LOCAL_RANK`` (and the default CUDA device)."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        # code that says only "cuda" (DDP's own checks too) must land on this process' device
        torch.cuda.set_device(device)
        return device
    if device.type != "cpu":
        raise ConfigError(
            f"config key 'torch_distributed': device {device} cannot train distributed; "
            "use a CUDA device (nccl) or the CPU (gloo)"
        )
    return device


# ---- the context ---------------------------------------------------------------------------


class DistributedContext:
    """This process' place among the ranks, and what the engine asks of it at its few hooks."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        reduce_type: str,
        param_sync_step: int | None,
        ddp_options: dict[str, Any],
        owns_group: bool,
    ):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.reduce_type, self.param_sync_step = device, reduce_type, param_sync_step
        self.ddp_options, self.owns_group = ddp_options, owns_group
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._step_module: _StepModule | None = None
        self._log_level: int | None = None
        if rank > 0:  # one log, not W copies of it
            self._log_level = logger.level
            logger.setLevel(max(logging.WARNING, logger.level))

    @property
    def is_main(self) -> bool:
        """Rank 0: writes the files and logs."""
        return self.rank == 0

    def __repr__(self) -> str:
        backend = dist.get_backend() if dist.is_initialized() else "closed"
        return (
            f"torch_distributed: rank {self.rank} of {self.world_size} (local rank {self.local_rank}, "
            f"{self.device}, {backend}), reduce_type {self.reduce_type!r}"
        )

    # ---- data --------------------------------------------------------------------------

    def pipeline(self, dataset: Dataset, config: Config, *, train: bool, **overrides: Any) -> Pipeline:
        """``Pipeline.from_config`` giving this rank's share of each epoch (see the module docstring)."""
        return _sharded_pipeline_class().from_config(
            dataset, config, train=train, shard=(self.rank, self.world_size, train), **overrides
        )

    # ---- model and steps ---------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module) -> None:
        """``"grad"``: wrap the model in DDP; ``"param"``: start every rank from rank 0's weights."""
        if self.reduce_type == "param":
            _broadcast_state(model)
            return
        from torch.nn.parallel import DistributedDataParallel

        self._step_module = _StepModule(model)
        # device_ids=None: the batch is on the device already, and DDP must not rebuild it
        self.ddp = DistributedDataParallel(self._step_module, **{"device_ids": None, **self.ddp_options})

    def train_step(self, fn: Callable[..., Any], *, sync: bool) -> Callable[..., Any]:
        """``fn`` run through DDP's forward; ``sync=False`` (inside a window) skips the gradient all-reduce."""
        if self.ddp is None:
            return fn
        ddp, step_module = self.ddp, self._step_module
        assert step_module is not None  # made together with self.ddp

        def train_step_in_ddp(*, model: torch.nn.Module, **kwargs: Any) -> None:
            step_module.call = (fn, kwargs)
            try:  # no_sync must cover the forward: DDP decides there whether backward all-reduces
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    ddp()
            finally:
                step_module.call = None

        train_step_in_ddp.__wrapped__ = fn  # type: ignore[attr-defined]
        return train_step_in_ddp

    def after_update(self, model: torch.nn.Module, num_updates: int) -> None:
        """``"param"``: average the weights every ``param_sync_step`` updates (counted globally)."""
        if self.reduce_type == "param" and self.param_sync_step and num_updates % self.param_sync_step == 0:
            average_parameters(model, self.world_size)

    def finish_train_epoch(self, model: torch.nn.Module, accounting: Any) -> None:
        """Epoch end: the scores of all ranks on every rank; ``"param"``: the same weights everywhere."""
        if self.reduce_type == "param":
            average_parameters(model, self.world_size)
        self.all_reduce_accounting(accounting)

    # ---- scores ------------------------------------------------------------------------

    def all_reduce_accounting(self, accounting: Any) -> None:
        """Every rank's accounting becomes the sum over all ranks (the same numbers everywhere)."""
        accounting.load_state_dict(merge_accounting(self._gather(accounting.state_dict())), self.device)

    def gather_accounting(self, accounting: Any) -> None:
        """Rank 0's accounting becomes the sum over all ranks, the others' empty (the sum is unchanged)."""
        merged = merge_accounting(self._gather(accounting.state_dict()))
        accounting.load_state_dict(merged if self.is_main else merge_accounting([]), self.device)

    def gather_from_ranks(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (a collective: every rank must call it)."""
        return self._gather(obj)

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # ---- files -------------------------------------------------------------------------

    def save_on_main(self, save: Callable[[], Any], accounting: Any = None) -> Any:
        """Rank 0 runs ``save``, with the loss sums of all ranks in ``accounting`` (mid-epoch); all wait."""
        if accounting is not None:
            self.gather_accounting(accounting)
        return self.on_main(save)

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only; every rank gets its result, or raises when it failed."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - the others must hear of it, then it is re-raised
                error = exc
        message = [(None if error is None else f"{type(error).__name__}: {error}", result)]
        dist.broadcast_object_list(message, src=0)
        if error is not None:
            raise error
        if message[0][0] is not None:
            raise KitError(f"rank 0 failed while the other ranks waited for it: {message[0][0]}")
        return message[0][1]

    def close(self) -> None:
        """Drop DDP and, when this context created it, destroy the process group."""
        self.ddp = self._step_module = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False
        if self._log_level is not None:
            logger.setLevel(self._log_level)
            self._log_level = None


class _StepModule(torch.nn.Module):
    """What DDP wraps: its forward runs the user's step on the user's module and returns the losses.

    DDP registers its gradient hooks on the parameters (the user's, under ``model.``) and arms
    them in its forward; the returned loss sums let ``find_unused_parameters`` trace the graph.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.call: tuple[Callable[..., Any], dict[str, Any]] | None = None

    def forward(self) -> list[torch.Tensor]:
        from kit.run_ctx import get_run_ctx

        if self.call is None:
            raise KitError("the DDP step module runs only inside DistributedContext.train_step")
        fn, kwargs = self.call
        fn(model=self.model, **kwargs)
        return [loss.sum for loss in get_run_ctx().losses.values() if loss.sum.requires_grad]


# ---- sharding -------------------------------------------------------------------------------


def shard(items: list[Any], rank: int, world_size: int, *, drop_remainder: bool) -> list[Any]:
    """Items ``rank, rank + W, ...``; with ``drop_remainder`` only of the first ``floor(n / W) * W``."""
    if drop_remainder:
        items = items[: len(items) // world_size * world_size]
    return items[rank::world_size]


_SHARDED: type | None = None


def _fewest_over_ranks(count: int) -> int:
    """The smallest ``count`` of all ranks (one collective; ``count`` itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return count
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, count)
    return min(int(c) for c in counts)


def _sharded_pipeline_class() -> type[Pipeline]:
    """``ShardedPipeline``, made on first use (kit.data loads only when data is needed)."""
    global _SHARDED
    if _SHARDED is None:
        from kit.data.pipeline import Pipeline

        class ShardedPipeline(Pipeline):
            """A Pipeline that keeps this rank's share of each epoch's batch plan."""

            def __init__(self, dataset: Dataset, *, shard: tuple[int, int, bool], **kwargs: Any):
                self.shard = shard
                super().__init__(dataset, **kwargs)

            def set_epoch(self, epoch: int) -> None:
                super().set_epoch(epoch)
                rank, world_size, drop_remainder = self.shard
                ranges = self._ranges or []
                planned = len(ranges)
                if getattr(self.dataset, "sharded_by_rank", False):
                    # the dataset read only this rank's files (DistributeFilesDataset): all its batches are
                    # this rank's; in training the sub-epoch ends when the first rank runs out (RETURNN)
                    if drop_remainder:
                        self._ranges = ranges[: _fewest_over_ranks(planned)]
                else:
                    self._ranges = shard(ranges, rank, world_size, drop_remainder=drop_remainder)
                if drop_remainder and not self._ranges:
                    raise DataError(
                        f"epoch {epoch} has {planned} batch(es) for {world_size} processes (torch_distributed): "
                        "every process needs at least one; use a smaller batch_size or more data"
                    )

        _SHARDED = ShardedPipeline
    return _SHARDED


def merge_accounting(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of ``EpochAccounting.state_dict()`` s, added in rank order (identical on every rank)."""
    totals: dict[str, torch.Tensor] = {}
    errors: set[str] = set()
    num_steps = 0
    for state in states:
        for name, pair in state["totals"].items():
            totals[name] = pair.clone() if name not in totals else totals[name] + pair
        errors |= set(state["errors"])
        num_steps += int(state["num_steps"])
    return {"totals": totals, "errors": sorted(errors), "num_steps": num_steps}


# ---- weights --------------------------------------------------------------------------------


def _floating_state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]


@torch.no_grad()
def average_parameters(model: torch.nn.Module, world_size: int) -> None:
    """Parameters and float buffers := their mean over the ranks (one all-reduce per device and dtype)."""
    for tensors in _groups(_floating_state(model)):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)  # SUM: gloo has no AVG
        flat.div_(world_size)
        _unflatten_into(flat, tensors)


@torch.no_grad()
def _broadcast_state(model: torch.nn.Module) -> None:
    for tensors in _groups([*model.parameters(), *model.buffers()]):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=0)
        _unflatten_into(flat, tensors)


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
