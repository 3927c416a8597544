"""``Engine``: RETURNN's PyTorch engine as a step machine.

The Session (notebook), the CLI and torchrun all step through the same loop
(:attr:`Engine.loop`, :mod:`kit.engine.loop`), whose units are ``train_step`` (one
micro-batch) and ``finish_epoch`` (scores, eval, LR, checkpoint, cleanup); ``eval_model``
and ``forward`` run the same forward code (:mod:`kit.engine.compute`). Nothing here prints,
draws or reads widgets; whoever wants to know subscribes to ``engine.events``, and a
debugger is reached through the typed :class:`~kit.engine.debugging.DebugProtocol`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kit.config import Config
from kit.data.batch import Batch
from kit.engine import amp, compute, distributed, epochs, parts, state
from kit.engine import start as start_
from kit.engine.accounting import EpochAccounting, stack_losses
from kit.engine.debugging import DebugContext, Debugger, DebugProtocol, RngState
from kit.engine.device import select_device
from kit.engine.evaluation import evaluate_dataset
from kit.engine.guard import NonFiniteGuard
from kit.engine.loop import EpochDone, TrainingLoop
from kit.engine.memory import MemoryFigures, MemoryMeter
from kit.engine.progress import Progress
from kit.engine.step import StepOptions, StepResult
from kit.engine.user_code import check_accepts_kwargs
from kit.errors import ConfigError, KitError
from kit.events import Events
from kit.rng import get_rng_state, set_rng_state, torch_rng_state
from kit.run_ctx import RunCtx
from kit.scores import ScoreTable, format_step_line

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.checkpoints.lock import PrefixLock
    from kit.data.extern_data import ExternData
    from kit.data.pipeline import Pipeline
    from kit.engine.lr_control import LearningRateControl
    from kit.engine.updater import Updater

__all__ = ["Engine", "StepOptions", "StepResult"]

logger = logging.getLogger("kit")


class Engine:
    """Train, evaluate and forward a model from a :class:`Config`.

    Construction is cheap; the device, model, optimizer and data pipeline are set up
    on first use (:meth:`setup`), resuming from the newest complete checkpoint.
    """

    def __init__(self, config: Config, *, events: Events | None = None):
        self.config = config
        self.events = events or Events()
        # RETURNN's task: "eval" / "forward" load the weights of load / load_epoch, never a training state
        self.task = "train"
        self.progress = Progress()
        self.loop = TrainingLoop(self)
        self.is_set_up = False
        self.device: torch.device | None = None  # chosen by the set-up
        self.amp_dtype: torch.dtype | None = None
        self.float_dtype: torch.dtype | None = None  # default_float_dtype: the model's and the steps' floats
        self.dist: distributed.DistributedContext | None = None  # set up under torchrun
        self.datasets: dict[str, Any] = {}  # config key ("train", "dev", "eval_datasets.<name>") -> dataset
        self.extern_data: ExternData | None = None
        self.model: torch.nn.Module | None = None
        self.updater: Updater | None = None
        self.grad_scaler: torch.amp.GradScaler | None = None
        self.lr_control: LearningRateControl | None = None
        self.train_pipeline: Pipeline | None = None
        self.accounting = EpochAccounting()
        self.scores: ScoreTable | None = None
        self.memory: MemoryMeter | None = None
        self.epoch_start_time = 0.0
        self.epoch_learning_rate = 0.0  # the epoch's (LR control)
        self.step_learning_rate = 0.0  # the last step's (dynamic_learning_rate may change it per step)
        self.last_checkpoint: Checkpoint | None = None
        self.last_failure: DebugContext | None = None  # what kit.debug.capture kept (no Session)
        # a privileged subscriber: called directly, so it may raise or stop
        self.debugger: DebugProtocol | None = None
        self.prefix_lock: PrefixLock | None = None  # while this engine trains into `model`
        if config.typed_value("debug_hook") is not None:  # the CLI and torchrun too; a Session installs its own
            self.debugger = Debugger(self, lambda: self.config.typed_value("debug_hook"), self.keep_failure)
        self.step_rng_state: RngState | None = None  # the RNG right before the last step's user code
        self.last_batch: Batch | None = None
        self._options: tuple[int, StepOptions] | None = None
        self._final_epoch: int | None = None
        self._eval_errors: dict[str, set[str]] = {}  # eval dataset -> its error score keys
        self.views: list[Any] = []  # subscribers the config asks for (use_tensorboard); closed by close()
        self.guard = NonFiniteGuard(self)

    def keep_failure(self, ctx: DebugContext) -> None:
        self.last_failure = ctx

    # ---- the parts, once set up (a clear error before) ------------------------------------

    @property
    def built_model(self) -> torch.nn.Module:
        return _built(self.model, "model")

    @property
    def built_updater(self) -> Updater:
        return _built(self.updater, "optimizer")

    @property
    def built_scores(self) -> ScoreTable:
        return _built(self.scores, "score table")

    @property
    def built_lr_control(self) -> LearningRateControl:
        return _built(self.lr_control, "learning-rate control")

    @property
    def built_pipeline(self) -> Pipeline:
        return _built(self.train_pipeline, "train pipeline")

    @property
    def built_memory(self) -> MemoryMeter:
        return _built(self.memory, "memory meter")

    @property
    def built_device(self) -> torch.device:
        return _built(self.device, "device")

    # ---- set-up -----------------------------------------------------------------------

    @property
    def final_epoch(self) -> int:
        """The last epoch to train: the config's ``num_epochs``, unless a driver moved it (``Session.extend``)."""
        return self._final_epoch if self._final_epoch is not None else self.config.int("num_epochs")

    @final_epoch.setter
    def final_epoch(self, epoch: int) -> None:
        self._final_epoch = epoch

    @property
    def all_trained(self) -> bool:
        """No epoch is running and the next one is past ``num_epochs``."""
        p = self.progress
        return not p.epoch_running and p.epoch > self.final_epoch

    @property
    def learning_rate(self) -> float | None:
        """The learning rate the optimizer holds now; None before the optimizer exists."""
        return self.built_updater.learning_rate if self.updater is not None else None

    @property
    def num_parameters(self) -> int | None:
        """Elements of the model's parameters; None before the model is built."""
        return sum(t.numel() for t in self.built_model.parameters()) if self.model is not None else None

    def memory_now(self) -> MemoryFigures | None:
        """Memory figures now (read when asked, never inside a step); None before set-up."""
        return self.built_memory.now() if self.memory is not None else None

    @property
    def model_prefix(self) -> str | None:
        return self.config.typed_value("model")

    def setup(self) -> None:
        """Device, datasets, score table, model (resumed or fresh), optimizer, LR control."""
        if self.is_set_up:
            return
        self.device, reason = select_device(self.config.typed_value("device"))
        self.dist = distributed.from_config(self.config, self.device)
        if self.dist:  # one process per device (cuda:LOCAL_RANK)
            self.device, reason = self.dist.device, f"{reason}; {self.dist}"
        logger.info("device: %s (%s)", self.device, reason)
        self.memory = MemoryMeter(self.device)
        if start_.is_training(self):  # the optimizer's class and keywords, before data and model are built
            from kit.engine.optimizer_check import check_optimizer

            check_optimizer(self.config)
        if self.model_prefix and start_.is_training(self) and (not self.dist or self.dist.is_main):
            from kit.checkpoints.lock import PrefixLock

            self.prefix_lock = PrefixLock.acquire(self.model_prefix)  # 'model' writable and ours, before any step
        self.datasets = parts.build_datasets(self.config)
        self._attach_config_views()
        self.extern_data = parts.build_extern_data(self.config)
        self.scores = parts.open_score_table(self.config)
        if self.dist and not self.dist.is_main:  # rank 0 alone writes the score file
            self.built_scores.path = None
        start = start_.find_start(self.config, self.scores, training=start_.is_training(self))
        start_.warn_config_changes(self.config, start)
        self.progress.epoch = start.epoch
        self.progress.global_train_step = start.global_train_step
        self.model = parts.create_model(self.config, self.built_device, start.epoch, start.global_train_step)
        start_.init_weights(self, start)
        self.float_dtype = amp.cast_to_default_float_dtype(self.built_model, self.config)  # as RETURNN: after loading
        self.grad_scaler = amp.make_grad_scaler(self.config, self.device)
        self.amp_dtype = amp.amp_dtype(self.config)
        self.is_set_up = True
        if start.train_state is not None:
            self.ensure_training_parts()
            state.load_train_state(self, start.train_state)
        if start.needs_eval:
            self.ensure_training_parts()
            self.record_eval(start.epoch - 1, self.eval_model())
            self.save_scores()

    def _attach_config_views(self) -> None:
        """Views that a config key turns on, for the CLI and a Session alike (rank 0 only)."""
        if self.config.bool("use_tensorboard") and start_.is_training(self) and (not self.dist or self.dist.is_main):
            from kit.tensorboard import TensorBoardLogger

            self.views.append(TensorBoardLogger.from_config(self.config, self.events,
                                                            lambda: self.progress.global_train_step))

    def ensure_training_parts(self) -> None:
        """Optimizer, LR control and the train pipeline — only needed for training."""
        self.setup()
        if self.updater is not None:
            return
        from kit.data.pipeline import Pipeline
        from kit.engine.lr_control import make_lr_control
        from kit.engine.updater import Updater

        if self.config.typed_value("train_step") is None:
            raise ConfigError("config key 'train_step' is not set: expected train_step(*, model, extern_data, **kwargs)")
        check_accepts_kwargs(self.config.typed_value("train_step"), "train_step")
        if self.datasets.get("train") is None:
            raise ConfigError("config key 'train' is not set: training needs a dataset")
        self.updater = Updater(self.config, self.built_model)
        self.lr_control = make_lr_control(self.config, self.built_scores)
        make_pipeline = self.dist.pipeline if self.dist else Pipeline.from_config  # a rank's share of each epoch
        self.train_pipeline = make_pipeline(self.datasets["train"], self.config, train=True,
                                            extern_data=self.extern_data)
        if self.dist:  # DDP, or every rank starts from rank 0's weights
            self.dist.prepare_model(self.built_model)

    # ---- one train step ---------------------------------------------------------------

    @property
    def step_options(self) -> StepOptions:
        if self._options is None or self._options[0] != self.config.version:
            self.guard.config_changed()
            self._options = (self.config.version, StepOptions.read(self.config))
        return self._options[1]

    def train_step(self, *, probe_lr: float | None = None) -> StepResult | None:
        """Train on the next micro-batch of the current epoch; None once the epoch's data is used up.
        ``probe_lr``: a probe step (the LR finder) at this learning rate, without log line or step checkpoint.

        Each line here costs ~1 µs (caches cold from the model's compute): parts are read once into
        locals, and what the config decides once per config version (``step_options``)."""
        if self.updater is None:
            self.ensure_training_parts()
        p, guard, updater, memory, device = self.progress, self.guard, self.updater, self.memory, self.device
        assert updater is not None and self.train_pipeline is not None and memory is not None and device is not None
        if not p.epoch_running:
            epochs.begin_epoch(self)
        if p.steps_exhausted:
            return None
        # fetch: the next batch of the planned epoch (CPU), then to the device
        batch = next(self.train_pipeline, None)
        if batch is None:
            p.steps_exhausted = True
            return None
        t0 = time.perf_counter()
        if self.events.has("step_begin"):
            self.events.emit("step_begin", epoch=p.epoch, step=p.step_in_epoch, batch=batch)
        batch_dev = compute.to_device(batch, device)
        self.last_batch = batch  # a reference only: debug contexts of "step" breaks read it
        opts = self.step_options
        guarded = opts.guard or guard.pending  # a guard turned off still settles the steps it holds
        if guarded:
            guard.begin_step()
        # window start: a fresh gradient accumulation window
        if p.accum_count == 0:
            updater.zero_grad()
        lr = epochs.set_step_learning_rate(self, opts) if probe_lr is None else self.set_probe_learning_rate(probe_lr)
        # run ctx: the user's train_step marks losses (autocast when torch_amp is set)
        ctx = RunCtx("train", train_flag=True, epoch=p.epoch, step=p.global_train_step)
        # for replaying this step when it fails; only a debugger replays (a few µs of host time per step)
        self.step_rng_state = torch_rng_state() if self.debugger is not None else None
        train_step = opts.train_step
        accum_multiple = opts.accum_fixed or epochs.accum_grad_multiple_step(self, batch, opts)
        if self.dist:  # through DDP's forward; gradients sync on the last micro-batch of a window (or epoch)
            last = p.accum_count + 1 >= accum_multiple or batch.complete_frac == 1
            train_step = self.dist.train_step(train_step, sync=last)
        compute.run_user_step(self, train_step, ctx, batch_dev, stage="train")
        # backward: scaled for float16; gradients of micro-batches are summed
        compute.backward(compute.total_loss(ctx), self.grad_scaler)
        p.accum_count += 1
        step_losses = stack_losses(ctx.losses)
        # guard: this micro-batch's losses and the gradients so far, before any clipping
        finite = guard.after_backward(step_losses, batch, rng_before=self.step_rng_state) if guarded else True
        # update when the accumulation window is complete
        updated, grad_norm = False, None
        if finite and p.accum_count >= accum_multiple:
            updated, grad_norm = self._update(guarded)
        # account: losses stay on the device (deferred guard: once its flag was read)
        guard.account(step_losses) if guarded else self.accounting.add(step_losses)
        # the result; the step's memory peak window closes (CUDA host counters; nothing is read elsewhere)
        result = StepResult(p.epoch, p.step_in_epoch, p.global_train_step, lr, updated,
                            time.perf_counter() - t0, batch.num_seqs, batch.complete_frac, step_losses, grad_norm,
                            memory.end_step())
        p.step_in_epoch, p.global_train_step = p.step_in_epoch + 1, p.global_train_step + 1
        if batch.complete_frac is not None:
            p.last_complete_frac = batch.complete_frac
        if guarded:
            guard.end_step()
        self.events.emit("step_end", result=result)
        if probe_lr is not None:
            return result
        # the log line and the step checkpoint, when due; the guard's flag is read where they read losses
        if result.step % opts.log_every == 0 and logger.isEnabledFor(logging.INFO):
            guard.check()
            logger.info(format_step_line(result.epoch, result.step, result.losses, result.seconds))
        if opts.save_every and p.global_train_step % opts.save_every == 0:
            self.save_checkpoint(kind="step")
        guard.step_returned()
        return result

    def _update(self, guarded: bool) -> tuple[bool, torch.Tensor | None]:
        """Unscale → gradient noise → clip → optimizer step (a no-op on the device after a NaN/Inf)."""
        p, updater, scaler = self.progress, self.updater, self.grad_scaler
        assert updater is not None
        optimizer = updater.optimizer
        p.accum_count = 0
        if scaler is not None:
            scaler.unscale_(optimizer)
        updater.apply_gradient_noise()
        grad_norm = updater.clip_gradients()
        step: Callable[[], object] = updater.optimizer_step if scaler is None else lambda: scaler.step(optimizer)
        self.guard.step_optimizer(step) if guarded else step()
        if scaler is not None:
            scaler.update()
        p.num_updates, p.consec_skipped_updates = p.num_updates + 1, 0
        if self.dist:  # reduce_type "param": average the weights every param_sync_step updates
            self.dist.after_update(self.built_model, p.num_updates)
        return True, grad_norm

    def set_probe_learning_rate(self, lr: float) -> float:
        """A probe step's learning rate (the LR finder); the next scheduled step sets its own again."""
        self.built_updater.set_learning_rate(lr)
        self.step_learning_rate = lr
        return lr

    # ---- epochs -----------------------------------------------------------------------

    def finish_epoch(self) -> dict[str, float]:
        """End the current epoch: train scores, eval, next LR, score file, checkpoint, cleanup."""
        p = self.progress
        if not p.epoch_running:
            raise KitError(f"no epoch is running (at the {p.where()})")
        while self.train_step() is not None:  # the epoch's remaining steps, if any
            pass
        if p.accum_count:  # a partial accumulation window: RETURNN drops it, kit applies it
            self.guard.refresh()  # the guard's mode as the config is now (it may have changed since the step)
            self._update(self.step_options.guard or self.guard.pending)
        self.guard.check()  # the epoch's scores read the losses anyway
        if self.dist:  # the loss sums of all ranks; reduce_type "param": the same weights everywhere
            self.dist.finish_train_epoch(self.built_model, self.accounting)
        return epochs.end_epoch(self)

    def epoch_scores(self, epoch: int) -> dict[str, Any]:
        """``{"learning_rate": .., "train_loss_ce": .., "dev_loss_ce": .., ...}`` of one epoch."""
        return {"learning_rate": self.built_scores.learning_rate(epoch), **self.built_scores.scores(epoch)}

    def train_epoch(self, should_stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """The rest of the current epoch (or the next one) and its end work, through the loop;
        None when ``should_stop`` stopped it first, or when every epoch is trained."""
        self.ensure_training_parts()
        # the guard's flag (deferred mode) is read when the call ends, before run_end says how it ended
        with self.loop.driven("epoch") as outcome, self.guard.deferred_reads():
            while (unit := self.loop.next_unit()) is not None:
                if isinstance(unit, EpochDone):
                    return unit.scores
                if should_stop is not None and should_stop():
                    outcome.value = "paused"
                    return None
        return None

    def train(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """Train up to ``num_epochs`` through the loop; True when finished, False when ``should_stop`` paused it."""
        self.ensure_training_parts()
        with self.loop.driven("train") as outcome, self.guard.deferred_reads():
            while self.loop.next_unit() is not None:
                if should_stop is not None and should_stop() and not self.all_trained:
                    outcome.value = "paused"
                    return False
        return True

    # ---- eval -------------------------------------------------------------------------

    def eval_datasets(self) -> dict[str, Any]:
        return parts.eval_datasets(self.datasets)

    def eval_model(self, datasets: Mapping[str, Any] | None = None) -> dict[str, dict[str, float]]:
        """Scores per eval dataset: ``train_step`` under no_grad with ``train_flag=False``.

        Training RNG is saved and restored around it, so evaluating never changes what
        training does next.
        """
        self.setup()
        datasets = dict(self.eval_datasets() if datasets is None else datasets)
        if not datasets:
            return {}
        self.events.emit("eval_begin", datasets=list(datasets))
        rng, was_training = get_rng_state(), self.built_model.training
        self.built_model.eval()
        try:
            with torch.no_grad():
                results = {}
                for name, dataset in datasets.items():
                    results[name], self._eval_errors[name] = evaluate_dataset(self, name, dataset)
        finally:
            set_rng_state(rng)
            self.built_model.train(was_training)
        self.events.emit("eval_end", scores=results)
        return results

    def record_eval(self, epoch: int, results: dict[str, dict[str, float]]) -> None:
        """Put eval results of ``epoch`` into the score table (error scores marked as such)."""
        for name, scores in results.items():
            self.built_scores.set_scores(epoch, scores, errors=self._eval_errors.get(name, set()))

    # ---- files ------------------------------------------------------------------------

    def save_scores(self) -> None:
        """Write the score file (rank 0 only: the others have no path)."""
        if self.built_scores.path:
            self.built_scores.save()

    def save_checkpoint(self, *, kind: str = "step", epoch: int | None = None) -> Any:
        """Write a checkpoint of the whole training state now (epoch or mid-epoch step)."""
        self.guard.check()  # never a checkpoint of a state the guard would rewind
        if self.dist:  # rank 0 writes (mid-epoch with the loss sums of all ranks so far); the others wait
            ckpt = self.dist.save_on_main(lambda: state.save(self, kind=kind, epoch=epoch),
                                          self.accounting if self.progress.epoch_running else None)
        else:
            ckpt = state.save(self, kind=kind, epoch=epoch)
        self.last_checkpoint = ckpt
        if not self.dist or self.dist.is_main:  # after every save, so that disk use stays bounded mid-epoch too
            state.cleanup(self)
        self.events.emit("checkpoint_saved", checkpoint=ckpt)
        return ckpt

    def restore(self, ckpt: Any, loaded: tuple[dict, dict | None] | None = None) -> None:
        """Rewind the whole training state (weights, optimizer, progress, data position, RNG, scores);
        ``loaded``: ``ckpt``'s (model file, training state) if already loaded and verified."""
        from kit import checkpoints

        self.ensure_training_parts()
        model_file, saved = loaded or checkpoints.load_checkpoint(ckpt)
        if saved is None:
            raise KitError(f"checkpoint {ckpt.path} has no training state to restore; use load() to inspect it")
        checkpoints.load_into_model(self.built_model, model_file["model"])
        self.guard.reset()
        self.accounting = EpochAccounting()
        state.load_train_state(self, saved)
        p = self.progress
        self.built_scores.remove_epochs_after(p.epoch - 1)
        if p.epoch_running:
            self.built_scores.set_learning_rate(p.epoch, self.epoch_learning_rate)
        self.save_scores()
        self.last_checkpoint = ckpt

    def forward(self, data: Any, callback: Any = None, *, seq_indices: list[int] | None = None) -> Any:
        from kit.engine.forward import run_forward

        self.setup()
        return run_forward(self, data, callback, seq_indices=seq_indices)

    def close(self) -> None:
        """Shut down data workers and drop the model and optimizer."""
        if self.train_pipeline is not None:
            self.built_pipeline.close()
        self.train_pipeline = None
        for view in self.views:
            view.close()
        self.views.clear()
        self.model = self.updater = self.grad_scaler = None
        if self.prefix_lock is not None:
            self.prefix_lock.release()
            self.prefix_lock = None
        if self.dist:  # destroys the process group it created
            self.dist.close()
            self.dist = None
        self.is_set_up = False


_Part = TypeVar("_Part")


def _built(part: _Part | None, what: str) -> _Part:
    if part is None:
        raise KitError(f"the engine's {what} is not set up yet (Engine.setup / ensure_training_parts)")
    return part
