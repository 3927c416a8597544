"""``Session``: train, pause, look, change your mind and continue — one object, never stale.

>>> session = kit.Session(get_model=..., train_step=..., train=ds, num_epochs=5)  # doctest: +SKIP
>>> session.train_step()       # one step → StepResult
>>> session.train_steps(100)   # continues where the last call stopped
>>> session.train_epoch()      # rest of the epoch, eval, checkpoint → scores

Every call runs the same :class:`kit.Engine` methods as the CLI. A session is a world of
its own: its RNG states are swapped in around its work, so two sessions stepped in turns
in one kernel each get exactly what they would get alone.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from kit.config import Config
from kit.engine.engine import Engine, StepResult
from kit.errors import ConfigError, KitError, SessionStateError
from kit.events import Events
from kit.session.breakpoints import Debugging
from kit.session.history import History
from kit.session.interrupts import InterruptGuard
from kit.session.ipython_refs import drop_stored_references
from kit.session.loop import Paused, TrainingLoop
from kit.session.world import World

__all__ = ["Paused", "Session"]

logger = logging.getLogger("kit")


class Session(TrainingLoop, Debugging):
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
        self.events = Events()
        self.engine = Engine(self.config, events=self.events)
        self._history = History(max_rows=history_max_rows)
        self.events.on("step_end", self._history.on_step_end)
        # a step the guard rewinds to (and every step after it) leaves the history
        self.events.on("nonfinite", lambda error, **_: self._history.truncate_after(error.global_train_step))
        self.live = live
        self._live_dashboard: Any = None
        self._dashboards: weakref.WeakSet = weakref.WeakSet()  # every dashboard() of this session
        self._progress_line: Any = None  # the default notebook progress (kit.widgets.progress)
        from kit import debug

        # called with a kit.debug.DebugContext on before_train_loop / exception / nonfinite / step
        self.debug_hook: Callable[..., Any] | None = self.config.typed_value("debug_hook") or debug.capture
        self.last_failure: Any = None
        self.engine.debugger = debug.Debugger(self.engine, self, lambda: self.debug_hook)
        self._break_step: int | None = None
        self._break_when: Callable[[StepResult], bool] | None = None
        self._guard = InterruptGuard()
        self.world = World()  # this session's RNG states and torch defaults, swapped in around its work
        self._inspecting: str | None = None  # set by checkpoints.load(): weights are not the training state
        self._stashed_state: dict | None = None
        self._mid_step: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._background: dict[str, Any] = {}
        self.yield_every_secs = 0.05  # async variants yield to the kernel at most this often
        self.status = "ready"

    @classmethod
    def from_config(cls, path: str | os.PathLike, /, **overrides: Any) -> Session:
        """A session from a RETURNN-style config file; keyword arguments override its keys."""
        options = {k: overrides.pop(k) for k in ("live", "history_max_rows") if k in overrides}
        return cls(Config.from_file(path, **overrides), **options)

    # ---- the session's world ----------------------------------------------------------

    @contextlib.contextmanager
    def _world(self) -> Iterator[None]:
        """This session's RNG states and torch defaults in, the caller's back afterwards (see :mod:`kit.session.world`)."""
        if self._closed:
            raise SessionStateError("this session is closed; create a new one")
        with self.world.entered():
            yield

    def _setup(self) -> None:
        with self._world():
            self.engine.setup()
            self._history.device = self.engine.device

    # ---- position and parts -----------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The user's model (what ``get_model`` returned)."""
        self._setup()
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self._training_parts()
        return self.engine.updater.optimizer

    @property
    def epoch(self) -> int:
        """The epoch being trained, or the next one when none is running."""
        self._setup()
        return self.engine.progress.epoch

    @property
    def global_train_step(self) -> int:
        """Train steps (micro-batches) done so far."""
        self._setup()
        return self.engine.progress.global_train_step

    @property
    def step_in_epoch(self) -> int:
        self._setup()
        return self.engine.progress.step_in_epoch

    @property
    def progress(self) -> Any:
        self._setup()
        return self.engine.progress

    @property
    def device(self) -> torch.device:
        self._setup()
        return self.engine.device

    @property
    def learning_rate(self) -> float:
        self._training_parts()
        return self.engine.updater.learning_rate

    def _training_parts(self) -> None:
        with self._world():
            self.engine._ensure_training_parts()
            self._history.device = self.engine.device

    # ---- checkpoints --------------------------------------------------------------------

    def save(self) -> Any:
        """Write a step checkpoint of the whole training state now."""
        self._check_can_train()
        if not self.config.typed_value("model"):
            raise ConfigError("config key 'model' is not set: saving needs a checkpoint path prefix")
        self._training_parts()
        with self._world():
            return self.engine.save_checkpoint(kind="step")

    @property
    def checkpoints(self) -> Any:
        """Browser over the checkpoint files: .table, .load, .restore, .compare, .widget()."""
        from kit.session.checkpoint_browser import CheckpointBrowser

        return CheckpointBrowser(self)

    def reload_latest(self) -> None:
        """Leave inspection: put back the training state from before ``checkpoints.load``,
        or (when there is none in memory) restore the newest complete checkpoint."""
        from kit import checkpoints

        if self._stashed_state is not None:
            checkpoints.load_into_model(self.engine.model, self._stashed_state)
            self._stashed_state = None
        else:
            loaded = checkpoints.load_latest(self.config.typed_value("model") or "")
            if loaded is None:
                raise SessionStateError("no weights kept in memory and no complete checkpoint to reload")
            self._restore(loaded[0], loaded[1:])
        self._inspecting = None
        self._mid_step = None
        self.status = "ready"

    def _restore(self, ckpt: Any, loaded: tuple | None = None) -> None:
        self._training_parts()
        with self._world():
            self.engine.restore(ckpt, loaded)
        self._history.truncate_after(self.engine.progress.global_train_step)
        self._inspecting = None
        self._stashed_state = None
        self._mid_step = None

    # ---- tools --------------------------------------------------------------------------

    def lr_find(self, start_lr: float = 1e-7, end_lr: float = 10.0, num_steps: int = 100, **options: Any) -> Any:
        """An exponential LR sweep on the next training batches → DataFrame (lr, loss, smoothed_loss)
        with ``.suggestion`` and ``.plot()``; afterwards the session is bitwise as it was.

        Works at any step boundary (mid-epoch too); refuses while training runs in the background.
        ``options``: ``smoothing``, ``diverge_factor``, ``loss`` (see :func:`kit.lr_finder.lr_find`).
        """
        if self.is_training:
            raise SessionStateError("lr_find: the session is training (in the background); "
                                    "call session.pause() and session.wait() first")
        self._check_can_train()
        from kit.lr_finder import lr_find

        self._training_parts()
        with self._world():
            return lr_find(self.engine, start_lr=start_lr, end_lr=end_lr, num_steps=num_steps, **options)

    # ---- eval and forward ---------------------------------------------------------------

    def eval(self, datasets: Any = None) -> dict[str, dict[str, float]]:
        """Scores per eval dataset: the config's (``dev``, ``eval``, ``eval_datasets``) or ``datasets``
        (a dataset, dataset dict, or name → dataset).

        The config's eval datasets evaluated at an epoch end (not mid-epoch, not while a
        checkpoint is loaded for inspection) are recorded in that epoch's score row.
        """
        self._setup()
        if datasets is not None and not isinstance(datasets, Mapping):
            datasets = {"eval": datasets}
        if datasets is not None:
            from kit.data import make_dataset

            datasets = {name: make_dataset(ds) for name, ds in datasets.items()}
        with self._world():
            results = self.engine.eval_model(datasets)
        p = self.engine.progress
        at_epoch_end = not p.epoch_running and p.epoch > 1 and not self._inspecting
        if datasets is None and at_epoch_end and self.engine.scores is not None:
            self.engine._record_eval(p.epoch - 1, results)
            self.engine._save_scores()
        return results

    def forward(self, data: Any, callback: Any = None, *, dataset: str | None = None) -> Any:
        """Outputs per sequence for a dataset, a Batch, or a list of seq tags of a known dataset.

        Returns a :class:`kit.ForwardResult` (seq tag → {output name: numpy array}), or None
        when ``callback`` (``init`` / ``process_seq`` / ``finish``) receives the outputs.
        Seq tags are looked up in this session's datasets; ``dataset="dev"`` (a config key,
        or a name in ``eval_datasets``) says which one when several hold the tags.
        """
        self._setup()
        if self.config.typed_value("forward_step") is None:
            raise ConfigError("config key 'forward_step' is not set: forward needs forward_step(*, model, extern_data, **kwargs)")
        from kit.data.batch import Batch

        seq_indices = None
        if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
            data, seq_indices = self._resolve_tags(list(data), dataset)
        elif isinstance(data, (Mapping, str)) and not isinstance(data, Batch):  # a Batch is a Mapping too
            from kit.data import make_dataset

            data = make_dataset(data)
        with self._world():
            return self.engine.forward(data, callback, seq_indices=seq_indices)

    def _resolve_tags(self, tags: list[str], name: str | None) -> tuple[Any, list[int]]:
        datasets = {k: v for k, v in self.engine.datasets.items() if v is not None}
        known = ", ".join(k.removeprefix("eval_datasets.") for k in datasets) or "none"
        if name is not None:
            key = name if name in datasets else f"eval_datasets.{name}"
            if key not in datasets:
                raise UnknownSeqTagError(f"forward(dataset={name!r}): no such dataset in this session (known: {known})")
            datasets = {key: datasets[key]}
        found: dict[int, tuple[str, Any, list[int]]] = {}
        for key, ds in datasets.items():
            try:
                found.setdefault(id(ds), (key, ds, [ds.get_seq_index(t) for t in tags]))
            except KeyError:
                continue
        if len(found) == 1:
            _, ds, indices = next(iter(found.values()))
            return ds, indices
        if found:
            where = ", ".join(repr(k.removeprefix("eval_datasets.")) for k, _, _ in found.values())
            raise UnknownSeqTagError(f"seq tags {tags[:3]} are in several datasets ({where}); "
                                     f"say which one: session.forward(tags, dataset=...)")
        missing = [t for t in tags if not any(_has_tag(ds, t) for ds in datasets.values())]
        scope = f"dataset {name!r}" if name else "any of this session's datasets"
        raise UnknownSeqTagError(f"unknown seq tag(s) {missing[:5]}: not in {scope} (known datasets: {known}; "
                                 f"their tags look like {_tag_examples(datasets)})")

    # ---- stores and views ---------------------------------------------------------------

    @property
    def scores(self) -> Any:
        """pandas DataFrame, one row per epoch: learning rate and scores (the run's metadata is in
        :attr:`scores_meta`; ``session.score_table.to_pandas()`` has both, as the score file)."""
        self._setup()
        return self.engine.scores.to_pandas("scores")

    @property
    def scores_meta(self) -> Any:
        """pandas DataFrame, one row per epoch: steps, train time, time, host, device, versions, memory."""
        self._setup()
        return self.engine.scores.to_pandas("meta")

    def plot(self, *, smoothing: float = 0.9) -> Any:
        """A matplotlib Figure: losses and error rates per step (raw and smoothed, on separate axes)
        and the scores per epoch (shows itself in a notebook; ``.savefig(path)`` writes it)."""
        from kit.scores import split_score_key
        from kit.widgets.training_plot import plot_training

        self._setup()
        errors = {split_score_key(k)[1] for k in self.engine.scores.error_keys} | set(self.engine.accounting.errors)
        return plot_training(self.history, self.scores, error_names=errors, smoothing=smoothing)

    @property
    def history(self) -> Any:
        """pandas DataFrame, one row per train step (losses, learning rate, seconds, memory)."""
        return self._history.to_pandas()

    @property
    def score_table(self) -> Any:
        self._setup()
        return self.engine.scores

    def on(self, event: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Subscribe ``fn(**payload)`` to an event (see ``kit.events``)."""
        return self.events.on(event, fn)

    def show_loop(self) -> str:
        """Print the training loop with what is attached to each event."""
        text = self.events.describe()
        print(text)
        return text

    def dashboard(self) -> Any:
        from kit.widgets import Dashboard

        dashboard = Dashboard(self)
        self._dashboards.add(dashboard)
        return dashboard

    def _show_progress(self) -> None:
        """The default of a train call in a notebook: a live progress line, unless a dashboard watches."""
        from kit.widgets.dashboard import default_mode

        if default_mode() != "widget" or any(not d.detached for d in self._dashboards):
            return
        if self._progress_line is None:
            from kit.widgets.progress import ProgressLine

            self._progress_line = ProgressLine(self)
        self._progress_line.start()

    def _end_progress(self, outcome: str) -> None:
        if self._progress_line is not None:
            self._progress_line.finish(outcome)

    def _show_dashboard(self) -> None:
        try:
            from IPython.display import display

            # one per call: the one before stops following, so that its cell keeps its own run's last frame
            if self._live_dashboard is not None:
                self._live_dashboard.detach()
            self._live_dashboard = self.dashboard()
            display(self._live_dashboard)
        except ImportError:
            pass

    # ---- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Free model, optimizer, workers and device memory.

        Also drops IPython's stored last exception (``sys.last_traceback``, ``%debug``'s
        frames, the last cell's error) and output-cache entries when they hold this
        session's model or optimizer — otherwise those would keep them alive.
        """
        if self._closed:
            return
        if self._thread is not None and self._thread.is_alive():
            self.pause()
            self._thread.join()
        engine = self.engine
        optimizer = getattr(engine.updater, "optimizer", None)
        parts = [p for p in (engine.model, engine.updater, optimizer) if p is not None]
        drop_stored_references({id(o) for o in (self, engine, *parts)}, {id(o) for o in parts})
        del parts, optimizer
        engine.close()
        self.release()
        self._stashed_state = None
        self._closed = True
        self.status = "closed"
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def resume_plan(self) -> str | None:
        """Before first use: where training will continue ("will resume from model.002, epoch 3"), read from
        the newest complete checkpoint's name (nothing is built, loaded or verified); None when it starts fresh."""
        from kit.checkpoints import list_checkpoints

        engine = self.engine
        prefix = engine.model_prefix
        if engine.is_set_up or not prefix or self.config.typed_value("start_epoch") not in ("auto", None):
            return None
        newest = next((c for c in reversed(list_checkpoints(prefix)) if c.complete), None)
        if newest is None:
            return None
        if newest.kind == "epoch" and newest.epoch >= engine.final_epoch:
            return f"trained to epoch {newest.epoch} (num_epochs={engine.final_epoch}), from {newest.name}"
        epoch = newest.epoch + 1 if newest.kind == "epoch" else newest.epoch
        step = f", global step {newest.global_train_step}" if newest.kind == "step" else ""
        return f"will resume from {newest.name}, epoch {epoch}{step}"

    def __repr__(self) -> str:
        p = self.engine.progress
        plan = self.resume_plan
        if plan is not None:
            return f"<kit.Session {self.status}: {plan}>"
        return (f"<kit.Session {self.status}: epoch {p.epoch}/{self.config.int('num_epochs')}, "
                f"step {p.step_in_epoch}, global step {p.global_train_step}>")

    def _repr_html_(self) -> str:
        from kit.widgets.summary import session_html

        return session_html(self)


class UnknownSeqTagError(KitError, KeyError):
    """``forward`` was given seq tags that no (or more than one) dataset of the session holds."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


def _tag_examples(datasets: Mapping[str, Any]) -> str:
    for ds in datasets.values():
        try:
            return ", ".join(repr(ds.get_seq_tag(i)) for i in range(min(2, len(ds))))
        except Exception:  # a dataset without tags or length: no examples
            continue
    return "?"


def _has_tag(dataset: Any, tag: str) -> bool:
    try:
        dataset.get_seq_index(tag)
        return True
    except KeyError:
        return False
