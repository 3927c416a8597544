"""``Session``: train, pause, look, change your mind and continue — one object, never stale.

>>> session = kit.Session(get_model=..., train_step=..., train=ds, num_epochs=5)  # doctest: +SKIP
>>> session.train_step()       # one step → StepResult
>>> session.train_steps(100)   # continues where the last call stopped
>>> session.train_epoch()      # rest of the epoch, eval, checkpoint → scores

The facade over objects it owns: the engine (whose loop every call steps through, as the
CLI does), the loop driver (:mod:`kit.session.loop`), the break points and debugger
(:mod:`kit.session.breakpoints`), the lifecycle (:mod:`kit.session.lifecycle`: status, inspection), the world of RNG
states and torch defaults (:mod:`kit.session.world`) and the per-step history
(:mod:`kit.session.history`). Views read it through the typed properties below and its
events, never through the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kit.config import Config
from kit.engine.debugging import DebugContext, Hook
from kit.engine.engine import Engine
from kit.engine.memory import MemoryFigures
from kit.engine.progress import Progress
from kit.engine.start import resume_plan
from kit.engine.step import StepResult
from kit.errors import ConfigError, SessionStateError
from kit.events import Events
from kit.scores import ScoreTable
from kit.session import inference
from kit.session.breakpoints import Breakpoints
from kit.session.history import History
from kit.session.ipython_refs import drop_references_to
from kit.session.lifecycle import SessionState, Status
from kit.session.loop import LoopDriver, Paused, check_n
from kit.session.seq_tags import UnknownSeqTagError
from kit.session.views import SessionViews
from kit.session.world import World

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.debug.replay_step import ReplayReport
    from kit.session.checkpoint_browser import CheckpointBrowser

__all__ = ["Paused", "Session", "Status", "UnknownSeqTagError"]

logger = logging.getLogger("kit")


class Session:
    """Drive the engine step by step from a notebook.

    ``Session(**config_keys)``, ``Session(config)`` and ``Session(config=config)`` are the
    same; keyword arguments next to a ``config`` override its keys (the given Config is
    copied, never changed). Construction is cheap: the model, optimizer, data workers and
    device memory are created on first use.

    Args:
        config: a :class:`Config` (or mapping of config keys).
        live: ``True``: show the live dashboard whenever training runs; ``None`` (default): in a
            notebook, each train call shows a one-line live progress (unless a dashboard of this
            session is open); ``False``: show nothing. A train call's ``live=`` overrides it.
        history_max_rows: bound of :attr:`history`; beyond it older steps are thinned out.
    """

    def __init__(self, config: Config | Mapping[str, Any] | None = None, *, live: bool | None = None,
                 history_max_rows: int = 100_000, **kwargs: Any):
        if isinstance(config, Config):
            self.config = config.copy().update(kwargs)
        elif config is None or isinstance(config, Mapping):
            self.config = Config(dict(config or {}), **kwargs)
        else:
            raise TypeError(f"Session(config=...): expected a kit.Config or a dict of config keys, got "
                            f"{type(config).__name__}; for a config file use kit.Session.from_config(path)")
        from kit import debug

        self.events = Events()
        self.engine = Engine(self.config, events=self.events)
        self.history_store = History(max_rows=history_max_rows)  # the one per-step store; views read it
        self.history_store.subscribe(self.events)
        self.history_store.memory_source = self.engine.memory_now  # None until the engine is set up
        self.live = live
        self.views = SessionViews(self)  # the dashboard or progress line a train call shows
        # called with a kit.debug.DebugContext on before_train_loop / exception / nonfinite / step
        self.debug_hook: Hook | None = self.config.typed_value("debug_hook") or debug.capture
        self.breakpoints = Breakpoints(self.engine, lambda: self.debug_hook)
        self.driver = LoopDriver(self)
        self.lifecycle = SessionState()
        self.world = World()  # this session's RNG states and torch defaults, swapped in around its work

    @classmethod
    def from_config(cls, path: str | os.PathLike, /, **overrides: Any) -> Session:
        """A session from a RETURNN-style config file; keyword arguments override its keys."""
        options = {k: overrides.pop(k) for k in ("live", "history_max_rows") if k in overrides}
        return cls(Config.from_file(path, **overrides), **options)

    # ---- the session's world ----------------------------------------------------------

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """This session's RNG states and torch defaults in, the caller's back afterwards (:mod:`kit.session.world`)."""
        if self.lifecycle.status is Status.CLOSED:
            raise SessionStateError("this session is closed; create a new one")
        return self.world.entered()

    def setup(self) -> None:
        """Device, datasets, score table and model (resumed or fresh); cheap once done."""
        with self.entered():
            self.engine.setup()

    def ensure_training_parts(self) -> None:
        """:meth:`setup`, then the optimizer, LR control and train pipeline."""
        with self.entered():
            self.engine.ensure_training_parts()

    # ---- position and parts (built on first use) --------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The user's model (what ``get_model`` returned)."""
        self.setup()
        return self.engine.built_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self.ensure_training_parts()
        return self.engine.built_updater.optimizer

    @property
    def epoch(self) -> int:
        """The epoch being trained, or the next one when none is running."""
        self.setup()
        return self.engine.progress.epoch

    @property
    def global_train_step(self) -> int:
        """Train steps (micro-batches) done so far."""
        self.setup()
        return self.engine.progress.global_train_step

    @property
    def step_in_epoch(self) -> int:
        self.setup()
        return self.engine.progress.step_in_epoch

    @property
    def progress(self) -> Progress:
        """The engine's live counters (where training stands)."""
        self.setup()
        return self.engine.progress

    @property
    def device(self) -> torch.device:
        self.setup()
        return self.engine.built_device

    @property
    def learning_rate(self) -> float:
        self.ensure_training_parts()
        return self.engine.built_updater.learning_rate

    # ---- what views read (no side effects: nothing is built) ----------------------------

    def progress_snapshot(self) -> Progress:
        """A copy of the counters now (resumed position only after set-up)."""
        return dataclasses.replace(self.engine.progress)

    @property
    def current_learning_rate(self) -> float | None:
        """The optimizer's learning rate; None before it exists."""
        return self.engine.learning_rate

    @property
    def num_parameters(self) -> int | None:
        """Parameter elements of the model; None before it is built."""
        return self.engine.num_parameters

    @property
    def model_class(self) -> str | None:
        return type(self.engine.model).__name__ if self.engine.model is not None else None

    @property
    def device_if_set_up(self) -> torch.device | None:
        return self.engine.device if self.engine.is_set_up else None

    @property
    def score_table_if_set_up(self) -> ScoreTable | None:
        return self.engine.scores

    def memory(self) -> MemoryFigures | None:
        """Memory figures now, from the engine's meter (None before set-up)."""
        return self.engine.memory_now()

    @property
    def final_epoch(self) -> int:
        """The last epoch ``train()`` goes to (``num_epochs``, or as ``extend`` / ``train(n)`` moved it)."""
        return self.engine.final_epoch

    @property
    def state(self) -> Status:
        """What the session does, as an enum (what views switch on)."""
        return self.lifecycle.status

    @property
    def status(self) -> str:
        """What the session does, as a line (``"ready"``, ``"error: RuntimeError: ..."``, ``"inspecting model.003"``)."""
        return self.lifecycle.text

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        return self.engine.last_checkpoint

    @property
    def last_failure(self) -> DebugContext | None:
        """The last failure or break point the debug hook kept (:func:`kit.debug.capture`)."""
        return self.breakpoints.last_failure

    @last_failure.setter
    def last_failure(self, ctx: DebugContext | None) -> None:
        self.breakpoints.last_failure = ctx

    # ---- training -----------------------------------------------------------------------

    def train_step(self) -> StepResult | Paused | DebugContext | None:
        """One step of the current epoch (rolling into the next epoch when this one is done)."""
        # no progress line for one step (a dashboard still shows it when ``live=True``)
        return self.driver.run("steps", 1, live=bool(self.live))

    def train_steps(self, n: int) -> StepResult | Paused | DebugContext | None:
        """``n`` more steps, continuing where the last call stopped; returns the last StepResult."""
        return self.driver.run("steps", check_n(n), live=None)

    def train_epoch(self, *, live: bool | None = None) -> Any:
        """Finish the current epoch (or train the next one): steps, scores, eval, checkpoint, LR."""
        return self.driver.run("epoch", live=live)

    def train(self, num_epochs: int | None = None, *, live: bool | None = None) -> Any:
        """Train up to epoch ``num_epochs`` (default: the config's); returns the last epoch's scores.

        ``num_epochs`` becomes the final epoch, raised or lowered; it cannot be below an
        epoch that is already trained or running.
        """
        if num_epochs is not None:
            self.driver.set_final_epoch(num_epochs, lower_ok=True)
        return self.driver.run("train", live=live)

    async def train_steps_async(self, n: int) -> Any:
        """Like :meth:`train_steps`, yielding to the event loop between steps (Pause button works)."""
        return await self.driver.run_async("steps", check_n(n), live=None)

    async def train_epoch_async(self, *, live: bool | None = None) -> Any:
        """Like :meth:`train_epoch`; ``await`` it in a notebook cell so widgets stay responsive."""
        return await self.driver.run_async("epoch", live=live)

    async def train_async(self, num_epochs: int | None = None, *, live: bool | None = None) -> Any:
        """Like :meth:`train`; ``await session.train_async()`` keeps the kernel responsive."""
        if num_epochs is not None:
            self.driver.set_final_epoch(num_epochs, lower_ok=True)
        return await self.driver.run_async("train", live=live)

    def train_in_background(self, goal: str = "train", n: int = 1, *, live: bool | None = None) -> threading.Thread:
        """Train in a thread (goal ``"train"``, ``"epoch"`` or ``"steps"``); the cell returns at once.

        ``session.pause()`` stops at the next step boundary, ``session.wait()`` joins and
        returns the result (or raises the error). Do not step other sessions meanwhile:
        global RNG states are process-wide.
        """
        return self.driver.start_background(goal, check_n(n) if goal == "steps" else 0, live=live)

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for :meth:`train_in_background`; returns its result or raises its error."""
        return self.driver.wait(timeout)

    def pause(self) -> None:
        """Stop the running train_* call at the next step boundary (e.g. from a button)."""
        self.driver.guard.request("pause requested")

    @property
    def is_training(self) -> bool:
        return self.lifecycle.status is Status.RUNNING

    @property
    def yield_every_secs(self) -> float:
        """The async variants yield to the kernel at most this often."""
        return self.driver.yield_every_secs

    @yield_every_secs.setter
    def yield_every_secs(self, secs: float) -> None:
        self.driver.yield_every_secs = secs

    def extend(self, num_epochs: int) -> None:
        """Raise the final epoch without resetting LR control or history; ``train()`` goes on to it."""
        self.driver.set_final_epoch(num_epochs, lower_ok=False)

    # ---- debugging ----------------------------------------------------------------------

    def break_on(self, step: int | None = None, *, when: Callable[[StepResult], bool] | None = None) -> None:
        """Stop a train_* call after global step ``step`` (or after any step where ``when(result)``).

        The call returns the ``DebugContext`` (also passed to ``debug_hook`` as event
        ``"step"``); the next train_* call continues the same epoch. ``break_on()`` clears.
        """
        self.breakpoints.set(step, when)

    def replay(self, ctx: DebugContext | None = None, *, anomaly: bool = True) -> ReplayReport:
        """Re-run exactly the captured step and report the first op/module producing NaN/Inf."""
        with self.entered():
            return self.breakpoints.replay(ctx, anomaly=anomaly)

    def release(self) -> None:
        """Free the batch and device tensors held by the last captured failure."""
        self.breakpoints.release()

    # ---- checkpoints --------------------------------------------------------------------

    def save(self) -> Checkpoint:
        """Write a step checkpoint of the whole training state now."""
        self.lifecycle.check_can_train()
        if not self.config.typed_value("model"):
            raise ConfigError("config key 'model' is not set: saving needs a checkpoint path prefix")
        self.ensure_training_parts()
        with self.entered():
            return self.engine.save_checkpoint(kind="step")

    @property
    def checkpoints(self) -> CheckpointBrowser:
        """Browser over the checkpoint files: .table, .load, .restore, .compare, .widget()."""
        from kit.session.checkpoint_browser import CheckpointBrowser

        return CheckpointBrowser(self)

    def inspect(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Put ``weights`` (of checkpoint ``name``) into the model for a look; the training weights are kept
        in memory, and training refuses until :meth:`restore` or :meth:`reload_latest`."""
        self.lifecycle.inspect(self.model, name, weights)

    def restore(self, ckpt: Checkpoint, loaded: tuple[dict, dict | None] | None = None) -> None:
        """Rewind the whole training state to ``ckpt`` (``loaded``: its files, already read and verified)."""
        self.ensure_training_parts()
        with self.entered():
            self.engine.restore(ckpt, loaded)
        self.history_store.truncate_after(self.engine.progress.global_train_step)
        self.lifecycle.consistent()

    def reload_latest(self) -> None:
        """Leave inspection: put back the training state from before ``checkpoints.load``,
        or (when there is none in memory) restore the newest complete checkpoint."""
        from kit import checkpoints

        if not self.lifecycle.put_back_training_weights(self.engine.built_model):
            loaded = checkpoints.load_latest(self.config.typed_value("model") or "")
            if loaded is None:
                raise SessionStateError("no weights kept in memory and no complete checkpoint to reload")
            self.restore(loaded[0], loaded[1:])
        self.lifecycle.consistent()

    # ---- tools --------------------------------------------------------------------------

    def lr_find(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_steps: int = 100, **options: Any) -> Any:
        """An exponential LR sweep on the next training batches → DataFrame (lr, loss, smoothed_loss)
        with ``.suggestion`` and ``.plot()``; afterwards the session is bitwise as it was.

        Works at any step boundary (mid-epoch too); refuses while training runs in the background.
        ``options``: ``smoothing``, ``diverge_factor``, ``loss`` (see :func:`kit.lr_finder.lr_find`).
        """
        return inference.find_lr(self, start_lr=start_lr, end_lr=end_lr, num_steps=num_steps, **options)

    # ---- eval and forward ---------------------------------------------------------------

    def eval(self, datasets: Any = None) -> dict[str, dict[str, float]]:
        """Scores per eval dataset: the config's (``dev``, ``eval``, ``eval_datasets``) or ``datasets``
        (a dataset, dataset dict, or name → dataset).

        The config's eval datasets evaluated at an epoch end (not mid-epoch, not while a
        checkpoint is loaded for inspection) are recorded in that epoch's score row.
        """
        return inference.evaluate(self, datasets)

    def forward(self, data: Any, callback: Any = None, *, dataset: str | None = None) -> Any:
        """Outputs per sequence for a dataset, a Batch, or a list of seq tags of a known dataset.

        Returns a :class:`kit.ForwardResult` (seq tag → {output name: numpy array}), or None
        when ``callback`` (``init`` / ``process_seq`` / ``finish``) receives the outputs.
        Seq tags are looked up in this session's datasets; ``dataset="dev"`` (a config key,
        or a name in ``eval_datasets``) says which one when several hold the tags.
        """
        return inference.forward(self, data, callback, dataset)

    # ---- stores and views ---------------------------------------------------------------

    @property
    def scores(self) -> Any:
        """pandas DataFrame, one row per epoch: learning rate and scores (the run's metadata is in
        :attr:`scores_meta`; ``session.score_table.to_pandas()`` has both, as the score file)."""
        return self.score_table.to_pandas("scores")

    @property
    def scores_meta(self) -> Any:
        """pandas DataFrame, one row per epoch: steps, train time, time, host, device, versions, memory."""
        return self.score_table.to_pandas("meta")

    def plot(self, *, smoothing: float = 0.9) -> Any:
        """A matplotlib Figure: losses and error rates per step (raw and smoothed, on separate axes)
        and the scores per epoch (shows itself in a notebook; ``.savefig(path)`` writes it)."""
        from kit.scores import split_score_key
        from kit.widgets.training_plot import plot_training

        table = self.score_table
        errors = {split_score_key(k)[1] for k in table.error_keys} | set(self.engine.accounting.errors)
        return plot_training(self.history, self.scores, error_names=errors, smoothing=smoothing)

    @property
    def history(self) -> Any:
        """pandas DataFrame, one row per train step (losses, learning rate, seconds, memory)."""
        return self.history_store.to_pandas()

    @property
    def score_table(self) -> ScoreTable:
        self.setup()
        return self.engine.built_scores

    def on(self, event: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Subscribe ``fn(**payload)`` to an event (see ``kit.events``)."""
        return self.events.on(event, fn)

    def off(self, event: str, fn: Callable[..., Any]) -> None:
        self.events.off(event, fn)

    def show_loop(self) -> str:
        """Print the training loop with what is attached to each event."""
        text = self.events.describe()
        print(text)
        return text

    def dashboard(self) -> Any:
        """A live view of this session (:class:`kit.widgets.Dashboard`); show it as a cell's last line."""
        return self.views.dashboard()

    # ---- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Free model, optimizer, workers and device memory.

        Also drops IPython's stored last exception (``sys.last_traceback``, ``%debug``'s
        frames, the last cell's error) and output-cache entries when they hold this
        session's model or optimizer — otherwise those would keep them alive.
        """
        if self.lifecycle.status is Status.CLOSED:
            return
        thread = self.driver.thread
        if thread is not None and thread.is_alive():
            self.pause()
            thread.join()
        drop_references_to(self, self.engine)
        self.engine.close()
        self.release()
        self.lifecycle.stashed_weights = None
        self.lifecycle.set(Status.CLOSED)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def resume_plan(self) -> str | None:
        """Before first use: where training will continue ("will resume from model.002, epoch 3"), read from
        the newest complete checkpoint's name (nothing is built, loaded or verified); None when it starts fresh."""
        return resume_plan(self.engine)

    def __repr__(self) -> str:
        p = self.engine.progress
        plan = self.resume_plan
        if plan is not None:
            return f"<kit.Session {self.status}: {plan}>"
        return (f"<kit.Session {self.status}: epoch {p.epoch}/{self.final_epoch}, "
                f"step {p.step_in_epoch}, global step {p.global_train_step}>")

    def _repr_html_(self) -> str:
        from kit.widgets.summary import session_html

        return session_html(self)
