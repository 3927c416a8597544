"""``Engine``: RETURNN's PyTorch engine as a step machine.

The Session (notebook), the CLI and torchrun all step through the same loop
(:attr:`Engine.loop`, :mod:`kit.engine.loop`), whose units are :meth:`Engine.train_step` (one
micro-batch: the algorithm box of :mod:`kit.engine.step`, with the log line and step checkpoint
the loop schedules around it) and :meth:`Engine.finish_epoch` (scores, eval, LR, checkpoint,
cleanup). ``eval_model`` and ``forward`` run the same forward code (:class:`~kit.engine.compute.Compute`).
The engine's parts are private; its collaborators get the parts they use (:mod:`kit.engine.parts`).
Nothing here draws or reads widgets; whoever wants to know subscribes to ``engine.events``.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kit.compat.seeding import seed_returnn_frontend
from kit.config import Config
from kit.engine import build, distributed, loader_draws, parts, saving, step
from kit.engine.accounting import EpochAccounting
from kit.engine.cuda_graph import GraphedStep
from kit.engine.debugging import DebugContext, Debugger, Hook
from kit.engine.evaluation import evaluate_dataset
from kit.engine.guard import GuardOptions
from kit.engine.loop import EpochDone, TrainingLoop
from kit.engine.memory import MemoryFigures
from kit.engine.progress import Progress
from kit.engine.run_hooks import RunHooks
from kit.engine.state import TrainingState, cpu_copy, detached_copy
from kit.engine.step import StepOptions, StepResult
from kit.errors import ConfigError, DataError, KitError
from kit.events import (
    CheckpointSaved,
    EpochBegin,
    EpochEnd,
    EvalBegin,
    EvalEnd,
    Events,
    Restored,
    StepBegin,
    StepEnd,
)
from kit.rng import RngState, epoch_seed, seed_all
from kit.scores import ScoreTable, format_step_line

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.checkpoints.lock import PrefixLock
    from kit.data.batch import Batch
    from kit.engine.lr_control import LearningRateControl
    from kit.engine.optimizer_step import OptimizerStep
    from kit.engine.parts import Built, Training

__all__ = ["Engine", "StepOptions", "StepResult"]

logger = logging.getLogger("kit")


class Engine:
    """Train, evaluate and forward a model from a :class:`Config`.

    Construction is cheap; the device, model, optimizer and data pipeline are set up on first
    use (:meth:`setup`), resuming from the newest complete checkpoint. ``task``: RETURNN's
    ``"train"``, ``"eval"`` or ``"forward"`` (the last two load ``load`` / ``load_epoch``'s weights,
    never a training state).
    """

    def __init__(self, config: Config, *, events: Events | None = None, task: str = "train",
                 shared_process: bool = False):
        self.config = config
        self._shared_process = shared_process  # a notebook kernel: process-wide settings stay as they are
        self.events = events or Events()
        self._log_mark: tuple[float, int, int] | None = None  # (perf_counter, epoch, global step) at the last log line
        self.loop = TrainingLoop(self)
        self.last_failure: DebugContext | None = None  # what kit.debug.capture kept (no Session)
        self._task = task
        self._progress = Progress()
        self._built: Built | None = None
        self._training: Training | None = None
        self._final_epoch: int | None = None
        self._options: tuple[int, StepOptions] | None = None
        self._graphed: GraphedStep | None = None  # torch_cuda_graph's step (built with the options)
        self._eval_errors: dict[str, set[str]] = {}  # eval dataset -> its error score keys
        self._loggers: list[Any] = []  # trackers the config asks for (kit.loggers); closed by close()
        self._lock: PrefixLock | None = None  # while this engine trains into `model`
        self._last_checkpoint: Checkpoint | None = None
        self._closed_scores: ScoreTable | None = None
        self._epoch_start_time = 0.0
        self._loaders = loader_draws.LoaderDraws(config)  # what RETURNN's DataLoaders draw from torch's generator
        self._calls = 0  # driver calls open now (deferred reads wait for their end)
        self._debugger: Debugger | None = None
        self._hooks = RunHooks(config)  # RETURNN's callbacks and memory switches of the config
        self._reloader: Any = None  # use_hot_reloading's ConfigReloader, made when first needed
        self._stop_pending: str | None = None  # a run tool asked the loop's driver to stop (torch_profile, ...)
        self._stop_reason: str | None = None
        if config.typed_value("debug_hook") is not None:  # the CLI and torchrun too; a Session attaches its own
            self.attach_debugger(lambda: self.config.typed_value("debug_hook"), self._keep_failure)

    def _keep_failure(self, ctx: DebugContext) -> None:
        self.last_failure = ctx

    def attach_debugger(self, hook_getter: Callable[[], Hook | None],
                        keeper: Callable[[DebugContext], None] | None = None) -> Debugger:
        """The debugger on the bus (replacing an earlier one): it calls ``hook_getter()``'s hook."""
        if self._debugger is not None:
            self._debugger.unsubscribe(self.events)
        self._debugger = Debugger(self, hook_getter, keeper)
        self._debugger.subscribe(self.events)
        self._options = None  # the steps keep their RNG for a replay now
        return self._debugger

    # ---- what others read (never builds anything) -------------------------------------------

    @property
    def debugger(self) -> Debugger | None:
        """The debugger on the bus (a Session's, or the config's ``debug_hook``'s); None without one."""
        return self._debugger

    @property
    def task(self) -> str:
        return self._task

    @task.setter
    def task(self, value: str) -> None:
        if self._built is not None:
            raise KitError(f"the engine is set up for task {self._task!r} already; set task before setup()")
        self._task = value

    @property
    def progress(self) -> Progress:
        """Where training stands (the loop's counters: read them, never assign them)."""
        return self._progress

    @property
    def is_set_up(self) -> bool:
        return self._built is not None

    @property
    def model(self) -> torch.nn.Module | None:
        return self._built.model if self._built is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._training.updater.optimizer if self._training is not None else None

    @property
    def compiled_optimizer_step(self) -> OptimizerStep | None:
        """``torch_optimizer_step``'s compiled / captured optimizer step (its phase counters); None when unset."""
        return self._training.updater.compiled_step if self._training is not None else None

    @property
    def device(self) -> torch.device | None:
        return self._built.device if self._built is not None else None

    @property
    def compute(self) -> Any:
        """The one forward/backward (:class:`~kit.engine.compute.Compute`); None before set-up."""
        return self._built.compute if self._built is not None else None

    @property
    def scores(self) -> ScoreTable | None:
        """The score table once set up (still readable after :meth:`close`); None before."""
        return self._built.scores if self._built is not None else self._closed_scores

    @property
    def datasets(self) -> dict[str, Any]:
        """Config key (``train``, ``dev``, ``eval``, ``eval_datasets.<name>``) → dataset, once set up."""
        return dict(self._built.datasets) if self._built is not None else {}

    @property
    def dist(self) -> distributed.DistributedContext | None:
        return self._built.dist if self._built is not None else None

    @property
    def learning_rate(self) -> float | None:
        """The learning rate the optimizer holds now; None before the optimizer exists."""
        return self._training.updater.learning_rate if self._training is not None else None

    @property
    def lr_control(self) -> LearningRateControl | None:
        """The learning-rate controller (RETURNN's: per-epoch rates, newbob's scores); None before training is prepared."""
        return self._training.schedule.lr_control if self._training is not None else None

    @property
    def num_parameters(self) -> int | None:
        model = self.model
        return sum(t.numel() for t in model.parameters()) if model is not None else None

    def memory_now(self) -> MemoryFigures | None:
        """Memory figures now (read when asked, never inside a step); None before set-up."""
        return self._built.memory.now() if self._built is not None else None

    @property
    def model_prefix(self) -> str | None:
        return self.config.typed_value("model")

    @property
    def prefix_lock(self) -> PrefixLock | None:
        """The lock this engine holds on its ``model`` prefix while it trains into it (None otherwise)."""
        return self._lock

    @property
    def writes_files(self) -> bool:
        """Whether this run writes checkpoints (False under RETURNN's ``dry_run`` and without ``model``)."""
        return bool(self.model_prefix) and not self.config.bool("dry_run")

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        return self._last_checkpoint

    @property
    def last_batch(self) -> Batch | None:
        """The last train step's batch (a break point's context reads it)."""
        return self._training.last_batch if self._training is not None else None

    @property
    def last_step_rng(self) -> RngState | None:
        """torch's RNG before the last train step's user code (kept while a debugger is attached)."""
        return self._training.step_rng if self._training is not None else None

    @property
    def final_epoch(self) -> int:
        """The last epoch to train: the config's ``num_epochs``, unless a driver moved it (``Session.extend``)."""
        return self._final_epoch if self._final_epoch is not None else self.config.int("num_epochs")

    def set_final_epoch(self, epoch: int) -> None:
        self._final_epoch = epoch

    @property
    def all_trained(self) -> bool:
        """No epoch is running and the next one is past ``num_epochs``."""
        return not self._progress.epoch_running and self._progress.epoch > self.final_epoch

    @property
    def training(self) -> bool:
        """This engine trains (``task="train"`` and the config has ``train`` and ``train_step``)."""
        return self._task == "train" and build.can_train(self.config)

    # ---- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Device, datasets, score table, model (resumed or fresh); cheap once done."""
        if self._built is not None:
            return
        self._hooks.startup()
        built, start, self._lock = build.build_parts(self.config, self.events, training=self.training,
                                                     shared_process=self._shared_process)
        self._built = built
        self._hooks.attach(self.events, request_stop=self.request_stop, final_epoch=lambda: self.final_epoch,
                           progress=lambda: self._progress, rank=built.dist.rank if built.dist else None,
                           world_size=built.dist.world_size if built.dist else 1, training=self.training)
        self._loggers = build.config_loggers(self.config, self.events, self.training, built.dist.rank if built.dist else 0,
                                             lambda: self._progress.global_train_step)
        self._progress = Progress.starting_at(start.epoch, start.global_train_step)
        if start.train_state is not None:
            self.prepare_training()
            self.restore_state(TrainingState.from_file(start.train_state, source=start.source), announce=False)
        if start.needs_eval:
            self.prepare_training()
            self.record_eval(start.epoch - 1, self.eval_model())
            self.save_scores()

    def prepare_training(self) -> None:
        """Optimizer, LR control and the train pipeline — only needed for training."""
        self.setup()
        if self._training is None:
            self._training = build.build_training(self.config, self._built_parts())

    def _built_parts(self) -> Built:
        self.setup()
        assert self._built is not None
        return self._built

    def _parts(self) -> tuple[Built, Training]:
        self.prepare_training()
        assert self._built is not None and self._training is not None
        return self._built, self._training

    def _step_options(self) -> StepOptions:
        """The config's step and guard settings, read once per config version."""
        if self._options is None or self._options[0] != self.config.version:
            b, t = self._parts()
            if t.guard.pending:  # a changed guard setting still settles the steps it holds
                t.guard.read(self)
            t.guard.configure(GuardOptions.read(self.config, accelerator=b.device.type != "cpu" and not _many_devices(
                b.model), distributed=b.dist is not None))
            self._options = (self.config.version, StepOptions.read(self.config, keep_rng=self._debugger is not None,
                                                                   reloader=self._hot_reloader()))
            self._graphed = GraphedStep.for_config(self.config, b, t, accum=self._options[1].accum_grad_multiple_step)
        return self._options[1]

    def _step_fn(self) -> Callable[..., StepResult]:
        """The step the loop runs: the eager box, or ``torch_cuda_graph``'s graphed / compiled one."""
        return step.train_step if self._graphed is None else self._graphed.train_step

    def _hot_reloader(self) -> Any:
        """RETURNN's ``use_hot_reloading`` (a terminal on stdin): the reloader the train step asks through."""
        from kit.engine import hot_reload

        if self._reloader is None and hot_reload.should_use(self.config):
            self._reloader = hot_reload.ConfigReloader(self.config)
        return self._reloader

    # ---- the loop's units ---------------------------------------------------------------------

    def train_step(self) -> StepResult | None:
        """The loop's step unit: the next micro-batch of the current epoch (begun when none runs), its
        ``step_end``, and the log line and step checkpoint when due; None once the epoch's data is used up."""
        b, t = self._parts()
        p, opts = self._progress, self._step_options()
        if not p.epoch_running:
            self._begin_epoch()
        if not p.steps_exhausted:
            t.guard.begin_step(self)  # before the fetch: a deferred mark must hold the data position before it
        started = time.perf_counter()
        batch = None if p.steps_exhausted else next(t.pipeline, None)
        if batch is None:
            p.data_exhausted()
            return None
        self.events.emit(StepBegin(p.epoch, p.step_in_epoch, batch))
        result = self._step_fn()(batch, started, p, b, t, opts)
        self.events.emit(StepEnd(result))
        # the log line and the step checkpoint, when due; the guard's flag is read where they read losses
        if result.step % opts.log_every == 0 and logger.isEnabledFor(logging.INFO):
            self.read_guard()
            logger.info(format_step_line(result.epoch, result.step, result.losses, self._wall_per_step(result)))
        if (opts.save_every and p.global_train_step % opts.save_every == 0 and not t.guard.retraining
                and self.writes_files):
            self.save_checkpoint(kind="step")
        if self._calls == 0:  # a bare call (outside any driver's call) reads the flag
            self.read_guard()
        return result

    def _wall_per_step(self, result: StepResult) -> float:
        """Wall-clock seconds per step since the last log line of this epoch (data, step, views, all that a
        progress bar's rate counts); the step's own seconds for the epoch's first line."""
        now = time.perf_counter()
        mark, self._log_mark = self._log_mark, (now, result.epoch, result.global_train_step)
        if mark is None or mark[1] != result.epoch or result.global_train_step <= mark[2]:
            return result.seconds
        return (now - mark[0]) / (result.global_train_step - mark[2])

    def probe_step(self, lr: float) -> StepResult:
        """One train step at the learning rate ``lr``, without events, log line or checkpoint, the guard in
        immediate mode (the LR finder's probe: take a :meth:`capture` first and :meth:`restore_state` after);
        when the epoch's data runs out, its batches come round again."""
        b, t = self._parts()
        p, opts = self._progress, self._step_options()
        if not p.epoch_running:
            self._begin_epoch(announce=False)
        kept = t.last_batch, t.step_rng  # what a break point's context would read
        t.schedule.hold(lr)
        try:
            with t.guard.replaying(silent=True):
                for _ in range(2):
                    t.guard.begin_step(self)
                    started, batch = time.perf_counter(), next(t.pipeline, None)
                    if batch is not None:
                        return self._step_fn()(batch, started, p, b, t, opts)
                    t.pipeline.set_epoch(p.epoch)
                    p.data_again()
        finally:
            t.schedule.hold(None)
            t.last_batch, t.step_rng = kept
        raise KitError("the training data gave no batch")

    def retrain(self, steps: int) -> None:
        """Train ``steps`` steps again after a rewind (the guard's deferred mode): the same units, without
        step checkpoints (those were written the first time)."""
        for _ in range(steps):
            if self.train_step() is None:
                return

    def finish_epoch(self) -> dict[str, Any]:
        """End the current epoch: its remaining steps, train scores, eval, next LR, score file, checkpoint."""
        b, t = self._parts()
        p = self._progress
        if not p.epoch_running:
            raise KitError(f"no epoch is running (at the {p.where()})")
        while self.train_step() is not None:  # the epoch's remaining steps, if any
            pass
        if p.accum_count:  # a partial accumulation window: RETURNN drops it, kit applies it
            step.update(p, b, t)
        self.read_guard()  # the epoch's scores read the losses anyway
        t.guard.epoch_boundary()
        if b.dist:  # the loss sums of all ranks; reduce_type "param": the same weights everywhere
            b.dist.finish_train_epoch(b.model, t.accounting)
        return self._end_epoch()

    def _begin_epoch(self, *, announce: bool = True) -> None:
        """The epoch's learning rate, seeds and data plan; ``epoch_begin`` (not for a probe)."""
        b, t = self._parts()
        p = self._progress
        lr = t.schedule.begin_epoch(p.epoch)
        # randomness depends on (random_seed, epoch, global step) only, not on process history
        # (and on the rank: DDP ranks must not all draw the same dropout masks)
        rank = (b.dist.rank,) if b.dist and b.dist.rank else ()  # rank 0 draws as one process
        seed = epoch_seed(p.epoch, p.global_train_step, self.config.int("random_seed"), *rank)  # RETURNN's
        seed_all(seed)
        seed_returnn_frontend(seed)  # RETURNN's frontend too (rf.set_random_seed), as its engine does
        t.pipeline.set_epoch(p.epoch)
        # what RETURNN's train DataLoader takes from torch's generator before its first batch (dropout masks follow)
        self._loaders.before_train(t.pipeline.batches_are_datapipe)
        t.accounting = EpochAccounting()
        p.begin_epoch()
        self._epoch_start_time = time.time()
        b.model.train()
        if announce:
            logger.info("start epoch %d, global train step %d, learning rate %g", p.epoch, p.global_train_step, lr)
            self._hooks.reset_memory_caches()
            self._hooks.epoch_start(epoch=p.epoch, step=p.global_train_step, model=b.model, dataset_name="train")
            self.events.emit(EpochBegin(p.epoch, lr))

    def _end_epoch(self) -> dict[str, Any]:
        """After the epoch's last step: train scores, eval, next LR, score file, checkpoint; ``epoch_end``."""
        b, t = self._parts()
        p, table = self._progress, b.scores
        epoch = p.epoch
        if t.accounting.num_steps == 0:
            raise DataError(f"epoch {epoch}: the training dataset gave no batches")
        table.set_scores(epoch, t.accounting.scores("train_loss_", exp=self.config.bool("calculate_exp_loss")),
                         errors=t.accounting.error_keys("train_loss_"))
        table.set_meta(epoch, **self._epoch_meta(b, t))
        self._hooks.epoch_end(epoch=epoch, step=p.global_train_step, model=b.model, dataset_name="train")
        self.record_eval(epoch, self.eval_model())
        p.end_epoch()
        logger.info("finished epoch %d: %s", epoch, format_scores(table.scores(epoch)))
        self.save_scores()
        if self.writes_files and (epoch % self.config.int("save_interval") == 0 or epoch >= self.final_epoch):
            self.save_checkpoint(kind="epoch", epoch=epoch)
        if p.epoch <= self.final_epoch:  # newbob decides with this epoch's scores; stored when epoch e+1 starts,
            # so the score file holds exactly one row per finished epoch (as RETURNN's after a crash); computed
            # after the save, so that a score the LR control cannot find loses no training
            logger.info("learning rate for epoch %d: %g", p.epoch, t.schedule.lr_control.calc_learning_rate_for_epoch(p.epoch))
        row = self.epoch_scores(epoch)
        self.events.emit(EpochEnd(epoch, row))
        return row

    def _epoch_meta(self, b: Built, t: Training) -> dict[str, Any]:
        """The run metadata of the epoch that just ended (the score file's meta columns)."""
        import kit

        p = self._progress
        return {
            # RETURNN's meaning: the global step at the epoch's start; its end under global_train_step_end
            "global_train_step": p.epoch_start_global_step,
            "global_train_step_end": p.global_train_step,
            "effective_learning_rate": t.schedule.step_lr,
            "epoch_num_train_steps": t.accounting.num_steps,
            "epoch_train_time_secs": round(time.time() - self._epoch_start_time, 3),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hostname": platform.node(),
            "device": str(b.device),
            "torch_version": torch.__version__,
            "kit_version": kit.__version__,
            "skipped_updates": p.skipped_updates_in_epoch,
            "peak_memory_bytes": b.memory.peak_bytes(),
        }

    def epoch_scores(self, epoch: int) -> dict[str, Any]:
        """``{"learning_rate": .., "train_loss_ce": .., "dev_loss_ce": .., ...}`` of one epoch."""
        table = self._built_parts().scores
        return {"learning_rate": table.learning_rate(epoch), **table.scores(epoch)}

    # ---- driver calls ---------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Ask the driver to stop at the next unit boundary (a run tool: ``torch_profile``, ``low time left``)."""
        self._stop_pending = self._stop_reason = reason

    def take_stop_request(self) -> str | None:
        """The pending stop request's reason, cleared (a driver stops for it); None when none is pending."""
        reason, self._stop_pending = self._stop_pending, None
        return reason

    @property
    def stop_reason(self) -> str | None:
        """Why a run tool last asked training to stop (the CLI's exit status reads it); None: never."""
        return self._stop_reason

    @contextlib.contextmanager
    def driver_call(self) -> Iterator[None]:
        """A driver's ``train_*`` call (or a time slice of one): the steps inside do not read the guard's
        deferred flag; it is read when the outermost call ends (also when it raises: a bad step before the
        error comes first). An interrupt leaves the flag for the next read."""
        self._calls += 1
        try:
            yield
        except Exception:
            self._calls -= 1
            if self._calls == 0:
                self.read_guard()
            raise
        except BaseException:
            self._calls -= 1
            raise
        self._calls -= 1
        if self._calls == 0:
            self.read_guard()

    def read_guard(self) -> None:
        """A read point of the guard's deferred flag (a rewind and the report when it is set)."""
        if self._training is not None and self._training.guard.pending:
            self._training.guard.read(self)

    def train_epoch(self, should_stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """The rest of the current epoch (or the next one) and its end work, through the loop;
        None when ``should_stop`` stopped it first, or when every epoch is trained."""
        self.prepare_training()
        with self.loop.driven("epoch") as outcome, self.driver_call():
            while (unit := self.loop.next_unit()) is not None:
                if isinstance(unit, EpochDone):
                    return unit.scores
                if (should_stop is not None and should_stop()) or self.take_stop_request():
                    outcome.value = "paused"
                    return None
        return None

    def train(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """Train up to ``num_epochs`` through the loop; True when finished, False when ``should_stop`` paused it."""
        self.prepare_training()
        with self.loop.driven("train") as outcome, self.driver_call():
            while self.loop.next_unit() is not None:
                if ((should_stop is not None and should_stop()) or self.take_stop_request()) and not self.all_trained:
                    outcome.value = "paused"
                    return False
        return True

    # ---- eval ---------------------------------------------------------------------------------

    def eval_datasets(self) -> dict[str, Any]:
        return parts.eval_datasets(self._built_parts().datasets)

    def eval_model(self, datasets: Mapping[str, Any] | None = None) -> dict[str, dict[str, float]]:
        """Scores per eval dataset: ``train_step`` under no_grad with ``train_flag=False``.

        Training RNG is saved and restored around it, so evaluating never changes what training does next.
        """
        b = self._built_parts()
        datasets = dict(self.eval_datasets() if datasets is None else datasets)
        if not datasets:
            return {}
        self.events.emit(EvalBegin(list(datasets)))
        self._hooks.reset_memory_caches()
        rng, was_training = RngState.capture(), b.model.training
        b.model.eval()
        try:
            with torch.no_grad():
                results = {}
                p = self._progress
                for name, dataset in datasets.items():
                    self._hooks.epoch_start(epoch=p.epoch, step=p.global_train_step, model=b.model, dataset_name=name)
                    results[name], self._eval_errors[name] = evaluate_dataset(
                        b, self.config, p, name, dataset, self._loaders)
                    self._hooks.epoch_end(epoch=p.epoch, step=p.global_train_step, model=b.model, dataset_name=name)
        finally:
            rng.restore()
            b.model.train(was_training)
        self.events.emit(EvalEnd(results))
        return results

    def record_eval(self, epoch: int, results: dict[str, dict[str, float]]) -> None:
        """Put eval results of ``epoch`` into the score table (error scores marked as such)."""
        for name, scores in results.items():
            self._built_parts().scores.set_scores(epoch, scores, errors=self._eval_errors.get(name, set()))

    # ---- the training state ---------------------------------------------------------------------

    def capture(self, *, on_device: bool = False) -> TrainingState:
        """A snapshot of the whole training state; :meth:`restore_state` puts it back bitwise. Its tensors
        are copies on the CPU (what a checkpoint writes), or ``on_device`` where they are (a fast copy)."""
        b, t = self._parts()
        p = self._progress
        copy = detached_copy if on_device else cpu_copy
        updater = t.updater.state_dict()
        optimizer = updater.pop("optimizer")
        grads = {n: copy(prm.grad) for n, prm in b.model.named_parameters() if prm.grad is not None}
        return TrainingState(
            progress=p.copy(),
            training_mode=b.model.training,
            rng=RngState.capture(),
            weights=copy(b.model.state_dict()),
            optimizer=copy(optimizer),
            updater=updater,
            grad_scaler=copy(b.compute.grad_scaler.state_dict()) if b.compute.grad_scaler else None,
            lr_control=cpu_copy(t.schedule.lr_control.state_dict()),
            learning_rates=t.schedule.state_dict(),
            pipeline=dict(t.pipeline.state_dict()) if p.epoch_running else None,
            accounting=t.accounting.state_dict() if p.epoch_running else None,
            grads=grads,
            scores=b.scores.to_json(),
            loaders=self._loaders.state_dict(),
        )

    def restore_state(self, state: TrainingState, *, announce: bool = True) -> None:
        """Put a :meth:`capture` (or a checkpoint's training state) back: weights (when it holds them),
        optimizer, scaler, LR, data position, open window, RNG; ``restored`` tells the views. The score table
        is not part of it: a rewind never crosses an epoch's end (the score table's own rows stay)."""
        from kit import checkpoints

        b, t = self._parts()
        if self._graphed is not None:  # new optimizer-state tensors: a captured graph would update the old ones
            self._graphed.invalidate()
        if state.weights is not None:
            checkpoints.load_into_model(b.model, state.weights)
        self._progress.move_to(state.progress)
        p = self._progress
        if state.optimizer is not None:
            t.updater.load_state_dict({**(state.updater or {}), "optimizer": state.optimizer})
        if state.grad_scaler is not None and b.compute.grad_scaler is not None:
            b.compute.grad_scaler.load_state_dict(state.grad_scaler)
            # GradScaler creates its scale tensor on the first scale() call; an open accumulation
            # window may be unscaled (finished at the epoch end) before any step scales in this process
            b.compute.grad_scaler.scale(torch.zeros((), device=b.device))
        if state.lr_control is not None:
            t.schedule.lr_control.load_state_dict(state.lr_control)
        t.schedule.load_state_dict(state.learning_rates or {}, epoch_running=p.epoch_running)
        t.accounting = EpochAccounting()
        t.guard.forget()
        if p.epoch_running:
            t.pipeline.load_state_dict(state.pipeline or {})
            if b.dist is None or b.dist.is_main:  # rank 0 saved the sums of all ranks
                t.accounting.load_state_dict(state.accounting or {"totals": {}, "errors": [], "num_steps": 0},
                                             b.device)
            b.model.train()
        params = dict(b.model.named_parameters())
        for name, prm in params.items():
            grad = (state.grads or {}).get(name)
            prm.grad = None if grad is None else grad.to(prm.device, copy=True)
        if state.training_mode is not None:
            b.model.train(state.training_mode)
        if state.loaders is not None:  # else a new process's loaders (RETURNN's files): as RETURNN would draw
            self._loaders.load_state_dict(state.loaders)
        state.rng.restore()
        if announce:
            self.events.emit(Restored(p.copy()))

    # ---- files ----------------------------------------------------------------------------------

    def save_scores(self) -> None:
        """Write the score file (rank 0 only: the others have no path)."""
        table = self._built_parts().scores
        if table.path:
            table.save()

    def save_checkpoint(self, *, kind: str = "step", epoch: int | None = None) -> Checkpoint:
        """Write a checkpoint of the whole training state now (epoch or mid-epoch step)."""
        if self.config.bool("dry_run"):
            raise ConfigError("dry_run is set: this run writes nothing (unset dry_run to save checkpoints)")
        b, _ = self._parts()
        self.read_guard()  # never a checkpoint of a state the guard would rewind
        p = self._progress

        def write() -> Checkpoint:
            return saving.save(self.config, self.capture(), kind=kind, epoch=epoch if epoch is not None else p.epoch,
                               lock=self._lock)

        if b.dist:  # rank 0 writes (mid-epoch with the loss sums of all ranks so far); the others wait
            ckpt = b.dist.save_on_main(write, self._training.accounting if self._training and p.epoch_running else None)
        else:
            ckpt = write()
        self._last_checkpoint = ckpt
        if b.dist_is_main:  # after every save, so that disk use stays bounded mid-epoch too
            saving.cleanup(self.config, b.scores, ckpt)
            if kind == "epoch":
                saving.drop_old_optimizer_state(self.config, ckpt)
        self.events.emit(CheckpointSaved(ckpt))
        return ckpt

    def cleanup_preview(self) -> list[Checkpoint]:
        """What ``cleanup_old_models`` would remove now (nothing is removed)."""
        return saving.cleanup(self.config, self.scores, self._last_checkpoint, dry_run=True)

    def restore(self, ckpt: Checkpoint, loaded: tuple[dict, dict | None] | None = None) -> None:
        """Rewind the whole training state to checkpoint ``ckpt`` (weights, optimizer, progress, data
        position, RNG, scores); ``loaded``: its (model file, training state) if already loaded and verified."""
        from kit import checkpoints

        b, _ = self._parts()
        model_file, saved = loaded or checkpoints.load_checkpoint(ckpt)
        if saved is None:
            raise KitError(f"checkpoint {ckpt.path} has no training state to restore; use load() to inspect it")
        state = TrainingState.from_file(saved, weights=model_file["model"], source=ckpt.path)
        self.restore_state(state, announce=False)  # the score table keeps its rows; those after the checkpoint go
        p = self._progress
        b.scores.remove_epochs_after(p.epoch - 1)
        if p.epoch_running and self._training is not None:
            b.scores.set_learning_rate(p.epoch, self._training.schedule.epoch_lr)
        self.save_scores()
        self._last_checkpoint = ckpt
        self.events.emit(Restored(p.copy()))

    def forward(self, data: Any, callback: Any = None, *, seq_indices: list[int] | None = None) -> Any:
        from kit.engine.forward import run_forward

        self._hooks.reset_memory_caches()
        return run_forward(self._built_parts(), self.config, self._progress, data, callback, seq_indices=seq_indices)

    def release_prefix_lock(self) -> None:
        """Give up the lock on ``model`` (a Session lends it to its worker processes for a call)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def take_prefix_lock(self) -> None:
        """Take the lock on ``model`` again after :meth:`release_prefix_lock` (no-op when held, or when this
        engine writes no checkpoints: not set up, not training, no ``model``, a rank other than 0)."""
        prefix = self.model_prefix
        if self._lock is None and self._built is not None and prefix and self.training and self._built.dist_is_main:
            from kit.checkpoints.lock import PrefixLock

            self._lock = PrefixLock.acquire(prefix)

    def close(self) -> None:
        """Shut down data workers and drop the model and optimizer."""
        if self._training is not None:
            self._training.pipeline.close()
        for view in self._loggers:
            view.close()
        self._loggers.clear()
        self._hooks.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._built is not None and self._built.dist:  # destroys the process group it created
            self._built.dist.close()
        if self._built is not None:
            self._closed_scores = self._built.scores  # the run's scores stay readable after close
        self._built = self._training = None


def format_scores(scores: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in scores.items()) or "(no scores)"


def _many_devices(model: torch.nn.Module) -> bool:
    return len({p.device for p in model.parameters()}) > 1
