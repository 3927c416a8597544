"""``Session``: train, pause, look, change your mind and continue — one object, never stale.

>>> session = kit.Session(get_model=..., train_step=..., train=ds, num_epochs=5)  # doctest: +SKIP
>>> session.train_step()       # one step → TrainResult
>>> session.train_steps(100)   # continues where the last call stopped
>>> session.train_epoch()      # rest of the epoch, eval, checkpoint → TrainResult with the scores

The facade over parts it owns (:class:`~kit.session.parts.SessionParts`): the engine (whose loop
every call steps through, as the CLI does), the loop driver (:mod:`kit.session.loop`), the break
points and debugger (:mod:`kit.session.breakpoints`), the lifecycle (:mod:`kit.session.lifecycle`),
the world of RNG states and torch defaults (:mod:`kit.session.world`) and the per-step history
(:mod:`kit.session.history`). Properties never build anything: the model and optimizer are built
by :meth:`Session.setup` or the first train call. Views read a session through :meth:`Session.info`
and its events.
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kit.config import Config
from kit.engine.debugging import DebugContext, Hook
from kit.engine.engine import Engine
from kit.engine.memory import MemoryFigures
from kit.engine.progress import Progress
from kit.engine.start import newest_complete, newest_returnn_epoch, planned_position, resume_plan
from kit.errors import SessionStateError
from kit.events import Event, Events
from kit.scores import ScoreTable
from kit.session import inference
from kit.session.breakpoints import Breakpoints
from kit.session.history import History
from kit.session.ipython_refs import drop_references_to
from kit.session.lifecycle import SessionState, Status, StatusLine
from kit.session.loop import LoopDriver, check_n
from kit.session.parts import SessionParts
from kit.session.result import TrainResult
from kit.session.seq_tags import UnknownSeqTagError
from kit.session.views import SessionViews
from kit.session.world import World

if TYPE_CHECKING:
    from kit.checkpoints import Checkpoint
    from kit.debug.replay_step import ReplayReport
    from kit.session.checkpoint_browser import CheckpointBrowser

__all__ = ["Session", "SessionInfo", "Status", "TrainResult", "UnknownSeqTagError"]


@dataclass(frozen=True)
class SessionInfo:
    """What a view shows of a session, read at one moment; building it builds nothing."""

    status: StatusLine
    progress: Progress  # a copy: where training stands (before set-up: where it will resume)
    final_epoch: int
    resume_plan: str | None  # before set-up: "will resume from model.002, epoch 3"; None once set up
    model_class: str | None
    num_parameters: int | None
    device: torch.device | None
    learning_rate: float | None
    memory: MemoryFigures | None
    score_table: ScoreTable | None
    history: History  # the per-step store (views read its rows; never write them)
    last_checkpoint: Checkpoint | None
    yield_every_secs: float


class Session:
    """Drive the engine step by step from a notebook.

    ``Session(**config_keys)``, ``Session(config)`` and ``Session(config=config)`` are the
    same; keyword arguments next to a ``config`` override its keys (the given Config is
    copied, never changed). Construction is cheap: the model, optimizer, data workers and
    device memory are created by :meth:`setup` or the first train call.

    Args:
        config: a :class:`Config` (or mapping of config keys).
        live: ``True``: show the live dashboard whenever training runs; ``None`` (default): in a
            notebook, each train call shows a one-line live progress (unless a dashboard of this
            session is open); ``False``: show nothing. A train call's ``live=`` overrides it.
        history_max_rows: bound of :attr:`history`; beyond it older steps are thinned out.
        yield_every_secs: the awaitable calls yield to the kernel at most this often.
    """

    def __init__(self, config: Config | Mapping[str, Any] | None = None, *, live: bool | None = None,
                 history_max_rows: int = 100_000, yield_every_secs: float = 0.05, **kwargs: Any):
        if isinstance(config, Config):
            self.config = config.copy().update(kwargs)
        elif config is None or isinstance(config, Mapping):
            self.config = Config(dict(config or {}), **kwargs)
        else:
            raise TypeError(f"Session(config=...): expected a kit.Config or a dict of config keys, got "
                            f"{type(config).__name__}; for a config file use kit.Session.from_config(path)")
        from kit import debug

        events = Events()
        engine = Engine(self.config, events=events, shared_process=True)
        history = History(max_rows=history_max_rows)  # the one per-step store; views read it
        history.subscribe(events)
        history.memory_source = engine.memory_now  # None until the engine is set up
        from kit.session.hot_edits import HotEdits

        HotEdits(self.config, history, model=lambda: engine.model, global_step=lambda: engine.progress.global_train_step,
                 scores=lambda: engine.scores, save_scores=engine.save_scores).attach(events)  # re-run cells
        # called with a kit.debug.DebugContext on before_train_loop / exception / nonfinite / step
        self.debug_hook: Hook | None = self.config.typed_value("debug_hook") or debug.capture
        self._parts = SessionParts(self.config, events, engine, history, SessionViews(self, live), SessionState(),
                                   World(), Breakpoints(engine, lambda: self.debug_hook))
        self._driver = LoopDriver(self._parts, yield_every_secs)
        self._trackers: list[Any] = []  # log_to's, closed with the session

    @classmethod
    def from_config(cls, path: str | os.PathLike, /, **overrides: Any) -> Session:
        """A session from a RETURNN-style config file; keyword arguments override its keys."""
        options = {k: overrides.pop(k) for k in ("live", "history_max_rows", "yield_every_secs") if k in overrides}
        return cls(Config.from_file(path, **overrides), **options)

    def setup(self) -> None:
        """Build device, datasets, score table and model (resumed or fresh), optimizer and train pipeline
        now (the first train call does it otherwise); cheap once done."""
        engine = self._parts.engine
        if engine.training:
            self._parts.prepare_training()
        else:
            self._parts.setup()

    # ---- where it stands (reads only) ---------------------------------------------------------

    @property
    def progress(self) -> Progress:
        """Where training stands (a copy). Before set-up: where training will resume, from the newest
        checkpoint's name (nothing is loaded), or epoch 1."""
        engine = self._parts.engine
        if not engine.is_set_up and (returnn_epoch := newest_returnn_epoch(self.config)) is not None:
            return Progress.starting_at(returnn_epoch + 1, 0)  # (the global step is in RETURNN's file)
        if not engine.is_set_up and (newest := newest_complete(self.config)) is not None:
            epoch, step = planned_position(newest)
            return Progress.starting_at(epoch, step)
        return engine.progress.copy()

    @property
    def status(self) -> StatusLine:
        """What the session does, as a line (``"ready"``, ``"error: RuntimeError: ..."``); ``.kind`` is the
        :class:`Status` enum views switch on."""
        return self._parts.lifecycle.line

    @property
    def engine(self) -> Engine:
        """The engine core this session drives (its public, read-only API), for tools beyond the notebook's."""
        return self._parts.engine

    @property
    def model(self) -> torch.nn.Module:
        """The user's model (what ``get_model`` returned), once built (:meth:`setup` or a train call)."""
        model = self._parts.engine.model
        if model is None:
            raise SessionStateError("the model is not built yet: call session.setup() or a train call first")
        return model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, once built (:meth:`setup` or a train call)."""
        optimizer = self._parts.engine.optimizer
        if optimizer is None:
            raise SessionStateError("the optimizer is not built yet: call session.setup() or a train call first")
        return optimizer

    def info(self) -> SessionInfo:
        """Everything a view shows, read now (nothing is built)."""
        parts = self._parts
        engine = parts.engine
        model = engine.model
        return SessionInfo(
            status=self.status, progress=self.progress, final_epoch=engine.final_epoch,
            resume_plan=None if engine.is_set_up else resume_plan(self.config, engine.final_epoch),
            model_class=type(model).__name__ if model is not None else None,
            num_parameters=engine.num_parameters, device=engine.device, learning_rate=engine.learning_rate,
            memory=engine.memory_now(), score_table=self._score_table(), history=parts.history,
            last_checkpoint=engine.last_checkpoint, yield_every_secs=self._driver.yield_every_secs)

    # ---- training -----------------------------------------------------------------------

    def train_step(self) -> TrainResult:
        """One step of the current epoch (rolling into the next epoch when this one is done)."""
        # no progress line for one step (a dashboard still shows it when the session is ``live=True``)
        return self._driver.run("steps", 1, live=bool(self._parts.views.live))

    def train_steps(self, n: int, *, processes: int | None = None) -> TrainResult:
        """``n`` more steps, continuing where the last call stopped (``processes``: see :meth:`train`)."""
        if (done := self._on_workers("steps", check_n(n), None, processes)) is not None:
            return done
        return self._driver.run("steps", check_n(n), live=None)

    def train_epoch(self, *, live: bool | None = None, processes: int | None = None) -> TrainResult:
        """Finish the current epoch (or train the next one): steps, scores, eval, checkpoint, LR."""
        if (done := self._on_workers("epoch", 0, live, processes)) is not None:
            return done
        return self._driver.run("epoch", live=live)

    def train(self, num_epochs: int | None = None, *, live: bool | None = None,
              processes: int | None = None) -> TrainResult:
        """Train up to epoch ``num_epochs`` (default: the config's); the result holds the last epoch's scores.

        ``num_epochs`` becomes the final epoch, raised or lowered; it cannot be below an
        epoch that is already trained or running. ``processes=N`` (N > 1) trains on N worker
        processes started by spawning, as torchrun's ranks would (:mod:`kit.multiproc`); the state
        comes home when the call returns. ``None``: as the paused epoch ran, else in this process.
        """
        if num_epochs is not None:
            self._driver.set_final_epoch(num_epochs, lower_ok=True)
        if (done := self._on_workers("train", 0, live, processes)) is not None:
            return done
        return self._driver.run("train", live=live)

    async def train_steps_async(self, n: int, *, processes: int | None = None) -> TrainResult:
        """Like :meth:`train_steps`, yielding to the event loop between steps (the Pause button works)."""
        if (call := self._on_workers("steps", check_n(n), None, processes, "awaitable")) is not None:
            return await call
        return await self._driver.run_async("steps", check_n(n), live=None)

    async def train_epoch_async(self, *, live: bool | None = None, processes: int | None = None) -> TrainResult:
        """Like :meth:`train_epoch`; ``await`` it in a notebook cell so widgets stay responsive."""
        if (call := self._on_workers("epoch", 0, live, processes, "awaitable")) is not None:
            return await call
        return await self._driver.run_async("epoch", live=live)

    async def train_async(self, num_epochs: int | None = None, *, live: bool | None = None,
                          processes: int | None = None) -> TrainResult:
        """Like :meth:`train`; ``await session.train_async()`` keeps the kernel responsive."""
        if num_epochs is not None:
            self._driver.set_final_epoch(num_epochs, lower_ok=True)
        if (call := self._on_workers("train", 0, live, processes, "awaitable")) is not None:
            return await call
        return await self._driver.run_async("train", live=live)

    def train_in_background(self, goal: str = "train", n: int = 1, *, live: bool | None = None,
                            processes: int | None = None) -> threading.Thread:
        """Train in a thread (goal ``"train"``, ``"epoch"`` or ``"steps"``); the cell returns at once.

        ``session.pause()`` stops at the next step boundary, ``session.wait()`` joins and
        returns the result (or raises the error). Do not step other sessions meanwhile:
        global RNG states are process-wide.
        """
        n = check_n(n) if goal == "steps" else 0
        if (thread := self._on_workers(goal, n, live, processes, "background")) is not None:
            return thread
        return self._driver.start_background(goal, n, live=live)

    def _on_workers(self, goal: str, n: int, live: bool | None, processes: int | None,
                    mode: str = "blocking") -> Any:
        """The call on worker processes (:mod:`kit.multiproc`); None when it runs in this process."""
        from kit.multiproc import driver

        return driver.train(self, self._parts, self._driver, goal, n, processes, live, mode)

    def wait(self, timeout: float | None = None) -> TrainResult | None:
        """Wait for :meth:`train_in_background`; returns its result or raises its error (None: still running)."""
        return self._driver.wait(timeout)

    def pause(self) -> None:
        """Stop the running train_* call at the next step boundary (e.g. from a button)."""
        self._driver.guard.request("pause requested")

    def extend(self, num_epochs: int) -> None:
        """Raise the final epoch without resetting LR control or history; ``train()`` goes on to it."""
        self._driver.set_final_epoch(num_epochs, lower_ok=False)

    # ---- debugging ----------------------------------------------------------------------

    def break_on(self, step: int | None = None, *, when: Callable[[Any], bool] | None = None) -> None:
        """Stop a train_* call after global step ``step`` (or after any step where ``when(result)``).

        The call's result has the ``DebugContext`` in ``.debug`` (also passed to ``debug_hook`` as
        event ``"step"``); the next train_* call continues the same epoch. ``break_on()`` clears.
        """
        self._parts.breakpoints.set(step, when)

    def replay(self, ctx: DebugContext | None = None, *, anomaly: bool = True) -> ReplayReport:
        """Re-run exactly the captured step and report the first op/module producing NaN/Inf."""
        with self._parts.entered():
            return self._parts.breakpoints.replay(ctx, anomaly=anomaly)

    @property
    def last_failure(self) -> DebugContext | None:
        """The last failure or break point the debug hook kept (:func:`kit.debug.capture`);
        ``.release()`` frees the batch and tensors it holds."""
        return self._parts.breakpoints.last_failure

    @last_failure.setter
    def last_failure(self, ctx: DebugContext | None) -> None:
        self._parts.breakpoints.last_failure = ctx

    # ---- checkpoints --------------------------------------------------------------------

    def save(self) -> Checkpoint:
        """Write a step checkpoint of the whole training state now."""
        self._parts.lifecycle.check_can_train()
        from kit.errors import ConfigError

        if not self.config.typed_value("model"):
            raise ConfigError("config key 'model' is not set: saving needs a checkpoint path prefix")
        self._parts.prepare_training()
        with self._parts.entered():
            return self._parts.engine.save_checkpoint(kind="step")

    @property
    def checkpoints(self) -> CheckpointBrowser:
        """Browser over the checkpoint files: .table, .load, .restore, .reload_latest, .compare, .widget()."""
        from kit.session.checkpoint_browser import CheckpointBrowser

        return CheckpointBrowser(self, self._parts)

    # ---- tools --------------------------------------------------------------------------

    def lr_find(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_steps: int = 100, **options: Any) -> Any:
        """An exponential LR sweep on the next training batches → DataFrame (lr, loss, smoothed_loss)
        with ``.suggestion`` and ``.plot()``; afterwards the session is bitwise as it was.

        Works at any step boundary (mid-epoch too); refuses while training runs in the background.
        ``options``: ``smoothing``, ``diverge_factor``, ``loss`` (see :func:`kit.lr_finder.lr_find`).
        """
        return inference.find_lr(self._parts, start_lr=start_lr, end_lr=end_lr, num_steps=num_steps, **options)

    def profile(self, steps: int = 10, *, top: int = 20, **options: Any) -> Any:
        """Train ``steps`` more steps under torch's profiler → :class:`kit.profile.ProfileReport`: ``.table``
        (pandas DataFrame of the ``top`` ops by self time), ``.trace_path`` (a Chrome trace in the run folder:
        the folder of ``model``, else the working directory) and ``.result`` (the TrainResult).
        ``options`` go to ``torch.profiler.profile`` (e.g. ``profile_memory=True``). See docs/run_tools.md."""
        from kit.profile import profile_steps

        model = self.config.typed_value("model")
        run_dir = os.path.dirname(os.path.abspath(model)) if model else os.getcwd()
        name = f"torch_profile.session-step{self.progress.global_train_step}.json"
        return profile_steps(self.train_steps, check_n(steps), run_dir, name, top=top, **options)

    # ---- eval and forward ---------------------------------------------------------------

    def eval(self, datasets: Any = None) -> dict[str, dict[str, float]]:
        """Scores per eval dataset: the config's (``dev``, ``eval``, ``eval_datasets``) or ``datasets``
        (a dataset, dataset dict, or name → dataset).

        The config's eval datasets evaluated at an epoch end (not mid-epoch, not while a
        checkpoint is loaded for inspection) are recorded in that epoch's score row.
        """
        return inference.evaluate(self._parts, datasets)

    def forward(self, data: Any, callback: Any = None, *, dataset: str | None = None) -> Any:
        """Outputs per sequence for a dataset, a Batch, or a list of seq tags of a known dataset.

        Returns a :class:`kit.ForwardResult` (seq tag → {output name: numpy array}), or None
        when ``callback`` (``init`` / ``process_seq`` / ``finish``) receives the outputs.
        Seq tags are looked up in this session's datasets; ``dataset="dev"`` (a config key,
        or a name in ``eval_datasets``) says which one when several hold the tags.
        """
        return inference.forward(self._parts, data, callback, dataset)

    # ---- stores and views ---------------------------------------------------------------

    @property
    def scores(self) -> Any:
        """pandas DataFrame, one row per epoch: learning rate and scores (the run's metadata is in
        :attr:`scores_meta`; ``session.info().score_table.to_pandas()`` has both, as the score file)."""
        return self._score_table().to_pandas("scores")

    @property
    def scores_meta(self) -> Any:
        """pandas DataFrame, one row per epoch: steps, train time, time, host, device, versions, memory."""
        return self._score_table().to_pandas("meta")

    def _score_table(self) -> ScoreTable:
        """The score table: the engine's once set up, else the score file as it is on disk (nothing built)."""
        table = self._parts.engine.scores
        if table is not None:
            return table
        from kit.engine.parts import open_score_table

        return open_score_table(self.config)

    def plot(self, *, smoothing: float = 0.9) -> Any:
        """A matplotlib Figure: losses and error rates per step (raw and smoothed, on separate axes)
        and the scores per epoch (shows itself in a notebook; ``.savefig(path)`` writes it)."""
        from kit.scores import split_score_key
        from kit.widgets.training_plot import plot_training

        errors = {split_score_key(k)[1] for k in self._score_table().error_keys} | self._parts.history.error_names
        return plot_training(self.history, self.scores, error_names=errors, smoothing=smoothing)

    @property
    def history(self) -> Any:
        """pandas DataFrame, one row per train step (losses, learning rate, seconds, memory)."""
        return self._parts.history.to_pandas()

    def on(self, event: Event | str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Subscribe ``fn(**payload)`` to an event (:class:`kit.Event`; see ``kit.events``)."""
        return self._parts.events.on(event, fn)

    def off(self, event: Event | str, fn: Callable[..., Any]) -> None:
        self._parts.events.off(event, fn)

    def show_loop(self) -> str:
        """Print the training loop with what is attached to each event."""
        text = self._parts.events.describe()
        print(text)
        return text

    def log_to(self, tracker: Any, /, **options: Any) -> Any:
        """Log this session's steps and epochs to a tracker: ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or
        ``"csv"`` (``options`` as the config key's dict: ``wandb_opts``, ``mlflow_opts``, ...), or a
        :class:`kit.loggers.Tracker`. Returns the tracker (``.close()`` turns it off; :meth:`close` closes it
        too); None on a torchrun rank other than 0 unless ``all_ranks=True``. See docs/trackers.md."""
        from kit.session.trackers import log_to

        engine = self._parts.engine
        made = log_to(self.config, self._parts.events, lambda: engine.progress.global_train_step, tracker, options)
        if made is not None:
            self._trackers.append(made)
        return made

    def dashboard(self) -> Any:
        """A live view of this session (:class:`kit.widgets.Dashboard`); show it as a cell's last line."""
        return self._parts.views.dashboard()

    # ---- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Free model, optimizer, workers and device memory.

        Also drops IPython's stored last exception (``sys.last_traceback``, ``%debug``'s
        frames, the last cell's error) and output-cache entries when they hold this
        session's model or optimizer — otherwise those would keep them alive.
        """
        parts = self._parts
        if parts.lifecycle.status is Status.CLOSED:
            return
        thread = self._driver.thread
        if thread is not None and thread.is_alive():
            self.pause()
            thread.join()
        from kit.multiproc import driver

        driver.close(self)  # the worker processes, if any
        drop_references_to([self, parts.engine], [parts.engine.model, parts.engine.optimizer])
        for tracker in self._trackers:
            tracker.close()
        self._trackers.clear()
        parts.engine.close()
        parts.breakpoints.release()
        parts.lifecycle.stashed_weights = None
        parts.lifecycle.set(Status.CLOSED)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        engine = self._parts.engine
        if not engine.is_set_up and (plan := resume_plan(self.config, engine.final_epoch)) is not None:
            return f"<kit.Session {self.status}: {plan}>"
        p = engine.progress
        return (f"<kit.Session {self.status}: epoch {p.epoch}/{engine.final_epoch}, "
                f"step {p.step_in_epoch}, global step {p.global_train_step}>")

    def _repr_html_(self) -> str:
        from kit.widgets.summary import session_html

        return session_html(self)

    # ---- old names (kept working; each says what replaced it) -----------------------------------

    def __getattr__(self, name: str) -> Any:
        old = _OLD_NAMES.get(name)
        if old is None or name.startswith("__"):
            raise AttributeError(f"'Session' object has no attribute {name!r}")
        replacement, get = old
        warnings.warn(f"session.{name} is an old name: use {replacement}", DeprecationWarning, stacklevel=2)
        return get(self)


def _restore(session: Session) -> Callable[..., None]:
    return session._parts.restore


def _release(session: Session) -> Callable[[], None]:
    return session._parts.breakpoints.release


# name -> (what to use instead, how to get it)
_OLD_NAMES: dict[str, tuple[str, Callable[[Session], Any]]] = {
    "epoch": ("session.progress.epoch", lambda s: s.progress.epoch),
    "global_train_step": ("session.progress.global_train_step", lambda s: s.progress.global_train_step),
    "step_in_epoch": ("session.progress.step_in_epoch", lambda s: s.progress.step_in_epoch),
    "state": ("session.status.kind", lambda s: s.status.kind),
    "device": ("session.info().device", lambda s: s.info().device),
    "learning_rate": ("session.info().learning_rate", lambda s: s.info().learning_rate),
    "final_epoch": ("session.info().final_epoch", lambda s: s.info().final_epoch),
    "score_table": ("session.info().score_table", lambda s: s._score_table()),
    "is_training": ("session.status.kind is kit.session.Status.RUNNING", lambda s: s.status.kind is Status.RUNNING),
    "release": ("session.last_failure.release()", _release),
    "reload_latest": ("session.checkpoints.reload_latest()", lambda s: s._parts.reload_latest),
    "restore": ("session.checkpoints.restore(...)", _restore),
    "inspect": ("session.checkpoints.load(...)", lambda s: s._parts.inspect),
    "last_checkpoint": ("session.info().last_checkpoint", lambda s: s._parts.engine.last_checkpoint),
    "yield_every_secs": ("Session(..., yield_every_secs=...)", lambda s: s._driver.yield_every_secs),
}
