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
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kit import rng
from kit.config import Config
from kit.engine.engine import Engine, StepResult
from kit.errors import ConfigError, KitError, SessionStateError
from kit.events import Events
from kit.history import History
from kit.interrupts import InterruptGuard

logger = logging.getLogger("kit")


@dataclass
class Paused:
    """Returned by a ``train_*`` call that stopped at a step boundary (interrupt or Pause)."""

    epoch: int
    step: int
    reason: str
    paused: bool = True

    def __str__(self) -> str:
        return (f"paused at epoch {self.epoch}, step {self.step} ({self.reason}) — "
                f"call train_epoch() or train() to continue")

    __repr__ = __str__


_PAUSED = object()


def _advance(gen: Generator, deadline: float | None) -> tuple[bool, Any]:
    """Drive ``gen`` until it returns (→ (True, value)) or ``deadline`` passes (→ (False, None))."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return True, stop.value
        if deadline is not None and time.monotonic() >= deadline:
            return False, None


class Session:
    """Drive the engine step by step from a notebook.

    ``Session(**config_keys)``, ``Session(config)`` and ``Session(config=config)`` are the
    same; keyword arguments next to a ``config`` override its keys (the given Config is
    copied, never changed). Construction is cheap: the model, optimizer, data workers and
    device memory are created on first use.

    Args:
        config: a :class:`Config` (or mapping of config keys).
        live: show the live dashboard whenever training runs.
        history_max_rows: bound of :attr:`history`; beyond it older steps are thinned out.
    """

    def __init__(self, config: Config | Mapping[str, Any] | None = None, *, live: bool = False,
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
        self.live = live
        self._live_dashboard: Any = None
        from kit import debug

        # called with a kit.debug.DebugContext on before_train_loop / exception / nonfinite / step
        self.debug_hook: Callable[..., Any] | None = self.config.typed_value("debug_hook") or debug.capture
        self.last_failure: Any = None
        self.engine.debugger = debug.Debugger(self.engine, self, lambda: self.debug_hook)
        self._break_step: int | None = None
        self._break_when: Callable[[StepResult], bool] | None = None
        self._guard = InterruptGuard()
        self._rng: tuple | None = None  # this session's RNG world, swapped in around its work
        self._defaults: tuple[torch.dtype, torch.device] | None = None  # its torch default dtype and device
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
        """Swap this session's RNG states and torch defaults (dtype, device) in, the caller's back afterwards.

        A session starts from the caller's state at its first use; from then on user code of
        one session (``torch.set_default_dtype`` in ``get_model``, say) never reaches another.
        """
        if self._closed:
            raise SessionStateError("this session is closed; create a new one")
        outer, outer_defaults = rng.snapshot(), _torch_defaults()
        if self._rng is not None:
            rng.restore(self._rng)
        if self._defaults is not None:
            _set_torch_defaults(self._defaults, outer_defaults)
        try:
            yield
        finally:
            self._rng, self._defaults = rng.snapshot(), _torch_defaults()
            rng.restore(outer)
            _set_torch_defaults(outer_defaults, self._defaults)

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

    # ---- training ---------------------------------------------------------------------
    #
    # Every train_* call is a generator of "units" (one train step, or one epoch end)
    # driven to its goal: all at once (train_*), in time slices with an await between
    # them (train_*_async), or in a thread (train_in_background). The loop is the same.

    def train_step(self) -> StepResult | Paused | None:
        """One step of the current epoch (rolling into the next epoch when this one is done)."""
        return self._run(lambda: self._units("steps", 1))

    def train_steps(self, n: int) -> StepResult | Paused | None:
        """``n`` more steps, continuing where the last call stopped; returns the last StepResult."""
        return self._run(lambda: self._units("steps", self._check_n(n)))

    def train_epoch(self, *, live: bool | None = None) -> dict[str, Any] | Paused:
        """Finish the current epoch (or train the next one): steps, scores, eval, checkpoint, LR."""
        return self._run(lambda: self._units("epoch"), live=live)

    def train(self, num_epochs: int | None = None, *, live: bool | None = None) -> dict[str, Any] | Paused:
        """Train up to epoch ``num_epochs`` (default: the config's); returns the last epoch's scores.

        ``num_epochs`` becomes the final epoch (the config's ``num_epochs``), raised or lowered;
        it cannot be below an epoch that is already trained or running.
        """
        if num_epochs is not None:
            self._set_final_epoch(num_epochs, lower_ok=True)
        return self._run(lambda: self._units("train"), live=live, allow_finished=True)

    async def train_steps_async(self, n: int) -> StepResult | Paused | None:
        """Like :meth:`train_steps`, yielding to the event loop between steps (Pause button works)."""
        return await self._run_async(lambda: self._units("steps", self._check_n(n)))

    async def train_epoch_async(self, *, live: bool | None = None) -> dict[str, Any] | Paused:
        """Like :meth:`train_epoch`; ``await`` it in a notebook cell so widgets stay responsive."""
        return await self._run_async(lambda: self._units("epoch"), live=live)

    async def train_async(self, num_epochs: int | None = None, *, live: bool | None = None) -> Any:
        """Like :meth:`train`; ``await session.train_async()`` keeps the kernel responsive."""
        if num_epochs is not None:
            self._set_final_epoch(num_epochs, lower_ok=True)
        return await self._run_async(lambda: self._units("train"), live=live, allow_finished=True)

    def train_in_background(self, goal: str = "train", n: int = 1, *, live: bool | None = None) -> threading.Thread:
        """Train in a thread (goal ``"train"``, ``"epoch"`` or ``"steps"``); the cell returns at once.

        ``session.pause()`` stops at the next step boundary, ``session.wait()`` joins and
        returns the result (or raises the error). Do not step other sessions meanwhile:
        global RNG states are process-wide.
        """
        if self._thread is not None and self._thread.is_alive():
            raise SessionStateError("this session is already training in the background; call wait() or pause()")
        units = (lambda: self._units("steps", self._check_n(n))) if goal == "steps" else (lambda: self._units(goal))
        self._guard.clear()
        self._prepare_run(live, allow_finished=goal == "train")
        self._background = {}

        def target() -> None:
            try:
                # finished here, not in wait(): status and the interrupt event come when the thread stops
                self._background["result"] = self._finish_run(self._drive_all(units))
            except BaseException as exc:
                self._background["error"] = exc

        self._thread = threading.Thread(target=target, name="kit-session-training", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for :meth:`train_in_background`; returns its result or raises its error."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        self._thread, outcome = None, self._background
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    @property
    def is_training(self) -> bool:
        return self.status == "running"

    def extend(self, num_epochs: int) -> None:
        """Raise the final epoch without resetting LR control or history; ``train()`` goes on to it."""
        self._set_final_epoch(num_epochs, lower_ok=False)

    def _set_final_epoch(self, num_epochs: int, *, lower_ok: bool) -> None:
        current = self.config.int("num_epochs")
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be an int >= 1, got {num_epochs!r}")
        if num_epochs < current and not lower_ok:
            raise ValueError(f"extend(num_epochs={num_epochs}): must be >= the current num_epochs {current}; "
                             f"use train(num_epochs={num_epochs}) to stop earlier")
        p = self.engine.progress
        done = p.epoch if p.epoch_running else p.epoch - 1
        if num_epochs < done:
            raise ValueError(f"num_epochs={num_epochs}: epoch {done} is already "
                             f"{'running' if p.epoch_running else 'trained'}; the final epoch cannot be earlier")
        self.config.update(num_epochs=num_epochs)
        if self.status == "finished" and num_epochs > done:
            self.status = "ready"

    @staticmethod
    def _check_n(n: int) -> int:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"train_steps(n): n must be an int >= 1, got {n!r}")
        return n

    def _units(self, goal: str, n: int = 0) -> Generator[None, None, Any]:
        """Run train steps / epoch ends towards ``goal``; yields between units."""
        engine, steps, last = self.engine, 0, None
        while True:
            if self._all_trained():
                self.status = "finished"
                return last if goal == "steps" else self._last_row()
            result = engine.train_step()
            if result is None:
                row = engine.finish_epoch()
                if goal == "epoch":
                    return row
            else:
                steps, last = steps + 1, result
                if self._break_matches(result):
                    return self._break_here(result)
                if goal == "steps" and steps >= n:
                    return last
            if self._guard.requested and not self._all_trained():
                return _PAUSED
            yield

    def _all_trained(self) -> bool:
        p = self.engine.progress
        return not p.epoch_running and p.epoch > self.engine.final_epoch

    # ---- debugging ----------------------------------------------------------------------

    def break_on(self, step: int | None = None, *, when: Callable[[StepResult], bool] | None = None) -> None:
        """Stop a train_* call after global step ``step`` (or after any step where ``when(result)``).

        The call returns the ``DebugContext`` (also passed to ``debug_hook`` as event
        ``"step"``); the next train_* call continues the same epoch. ``break_on()`` clears.
        """
        self._break_step, self._break_when = step, when

    def _break_matches(self, result: StepResult) -> bool:
        if self._break_step is not None and result.global_train_step == self._break_step:
            self._break_step = None
            return True
        return self._break_when is not None and bool(self._break_when(result))

    def _break_here(self, result: StepResult) -> Any:
        ctx = self.engine.debugger.context("step", batch=self.engine.last_batch, step_losses=result.step_losses,
                                           rng=None)
        self.engine.debugger.call_hook(ctx)  # RNG states put back afterwards: a hook never changes training
        self.last_failure = ctx
        self.status = "paused"
        return ctx

    def replay(self, ctx: Any = None, *, anomaly: bool = True) -> Any:
        """Re-run exactly the captured step and report the first op/module producing NaN/Inf."""
        from kit import debug

        ctx = ctx if ctx is not None else self.last_failure
        if ctx is None:
            raise SessionStateError("nothing to replay: session.last_failure is empty (no failure captured)")
        with self._world():
            return debug.replay(self.engine, ctx, anomaly=anomaly)

    def release(self) -> None:
        """Free the batch and device tensors held by the last captured failure."""
        if self.last_failure is not None:
            self.last_failure.release()
        self.last_failure = None

    def _last_row(self) -> dict[str, Any]:
        epochs = self.engine.scores.epochs
        return self.engine.epoch_scores(epochs[-1]) if epochs else {}

    def _run(self, units: Callable[[], Generator], *, live: bool | None = None, allow_finished: bool = False) -> Any:
        # the handler is in place before the set-up (model build, resume) so that an interrupt
        # there pauses after the first step instead of tearing the set-up apart
        self._guard.clear()
        with self._guard.held():
            self._prepare_run(live, allow_finished)
            return self._finish_run(self._drive_all(units))

    async def _run_async(self, units: Callable[[], Generator], *, live: bool | None = None,
                         allow_finished: bool = False) -> Any:
        import asyncio

        self._guard.clear()
        with self._guard.held():
            self._prepare_run(live, allow_finished)
            gen = units()
            while True:
                deadline = time.monotonic() + self.yield_every_secs
                with self._world(), self._errors_tracked():
                    done, result = _advance(gen, deadline)
                if done:
                    return self._finish_run(result)
                await asyncio.sleep(0)  # let the kernel handle widget messages (the Pause button)

    def _drive_all(self, units: Callable[[], Generator]) -> Any:
        with self._world(), self._errors_tracked():
            return _advance(units(), None)[1]

    def _prepare_run(self, live: bool | None, allow_finished: bool) -> None:
        """Preconditions of every train_* call, and the dashboard when asked."""
        self._check_can_train()
        with self._forced_interrupt_marked():
            self._training_parts()
        p = self.engine.progress
        if not allow_finished and not p.epoch_running and p.epoch > self.engine.final_epoch:
            raise SessionStateError(f"all {self.engine.final_epoch} epochs are trained; "
                                    "call session.extend(num_epochs) or session.train(num_epochs) to train more")
        if live if live is not None else self.live:
            self._show_dashboard()
        self.status = "running"

    @contextlib.contextmanager
    def _forced_interrupt_marked(self) -> Iterator[None]:
        """A KeyboardInterrupt (second interrupt within a second) may leave a half-updated state:
        remember where, so that train_* refuses until restore / reload_latest."""
        try:
            yield
        except KeyboardInterrupt:
            self._mid_step = self.engine.progress.where()
            self.status = "error: interrupted mid-step"
            raise

    @contextlib.contextmanager
    def _errors_tracked(self) -> Iterator[None]:
        """A forced interrupt mid-step marks the session inconsistent; errors set the status."""
        try:
            with self._forced_interrupt_marked():
                yield
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.status = f"error: {type(exc).__name__}: {exc}".split("\n")[0]
            raise

    def _finish_run(self, result: Any) -> Any:
        if result is _PAUSED:
            return self._paused()
        if self._guard.requested:  # it came as the last unit finished: the goal is reached anyway
            logger.info("%s arrived as the train call finished; nothing to pause", self._guard.reason)
            self._guard.clear()
        if self.status == "running":
            self.status = "ready"
        return result

    def _paused(self) -> Paused:
        p = self.engine.progress
        paused = Paused(p.epoch, p.step_in_epoch, self._guard.reason or "pause requested")
        self._guard.clear()
        self.status = "paused"
        logger.warning("%s", paused)
        self.events.emit("interrupt", status=paused)
        return paused

    def pause(self) -> None:
        """Stop the running train_* call at the next step boundary (e.g. from a button)."""
        self._guard.request("pause requested")

    def _check_can_train(self) -> None:
        if self._inspecting:
            raise SessionStateError(
                f"the model holds the weights of {self._inspecting} for inspection (checkpoints.load); "
                "call session.checkpoints.restore(...) to continue from that checkpoint, or "
                "session.reload_latest() to go back to the training state")
        if self._mid_step:
            raise SessionStateError(
                f"the last train call was interrupted mid-step (a second interrupt within a second) at "
                f"{self._mid_step}: the model or optimizer may be half-updated; call "
                "session.checkpoints.restore(...) or session.reload_latest() to continue from a consistent state")

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
        from kit.checkpoint_browser import CheckpointBrowser

        return CheckpointBrowser(self)

    def reload_latest(self) -> None:
        """Leave inspection: put back the training state from before ``checkpoints.load``,
        or (when there is none in memory) restore the newest complete checkpoint."""
        from kit import checkpoints

        if self._stashed_state is not None:
            checkpoints.load_into_model(self.engine.model, self._stashed_state)
            self._stashed_state = None
        else:
            ckpt = checkpoints.latest(self.config.typed_value("model") or "")
            if ckpt is None:
                raise SessionStateError("no weights kept in memory and no complete checkpoint to reload")
            self._restore(ckpt)
        self._inspecting = None
        self._mid_step = None
        self.status = "ready"

    def _restore(self, ckpt: Any) -> None:
        self._training_parts()
        with self._world():
            self.engine.restore(ckpt)
        self._history.truncate_after(self.engine.progress.global_train_step)
        self._inspecting = None
        self._stashed_state = None
        self._mid_step = None

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
        """pandas DataFrame, one row per epoch — the same as the score file."""
        self._setup()
        return self.engine.scores.to_pandas()

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

        return Dashboard(self)

    def _show_dashboard(self) -> None:
        try:
            from IPython.display import display

            if self._live_dashboard is None:  # one live dashboard per session, not one per call
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
        _drop_stored_references({id(o) for o in (self, engine, *parts)}, {id(o) for o in parts})
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

    def __repr__(self) -> str:
        p = self.engine.progress
        return (f"<kit.Session {self.status}: epoch {p.epoch}/{self.config.int('num_epochs')}, "
                f"step {p.step_in_epoch}, global step {p.global_train_step}>")

    def _repr_html_(self) -> str:
        from kit.widgets.summary import session_html

        return session_html(self)


def _torch_defaults() -> tuple[torch.dtype, torch.device]:
    return torch.get_default_dtype(), torch.get_default_device()


def _set_torch_defaults(wanted: tuple[torch.dtype, torch.device], now: tuple[torch.dtype, torch.device]) -> None:
    """Change only what differs: a default device is a global torch function mode (a cost on every op),
    so "cpu" is set as no default device at all."""
    if wanted[0] != now[0]:
        torch.set_default_dtype(wanted[0])
    if wanted[1] != now[1]:
        torch.set_default_device(None if wanted[1] == torch.device("cpu") else wanted[1])


def _holds(exc: BaseException | None, refs: set[int]) -> bool:
    """Whether a frame of ``exc``'s traceback (or of its cause/context chain) holds one of ``refs``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _tb_holds(exc.__traceback__, refs):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _tb_holds(tb: Any, refs: set[int]) -> bool:
    while tb is not None:
        if any(id(v) in refs for v in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def _drop_stored_references(frame_refs: set[int], value_refs: set[int]) -> None:
    """Forget stored exceptions whose frames hold ``frame_refs``, and cached outputs in ``value_refs``."""
    last = getattr(sys, "last_value", None) or getattr(sys, "last_exc", None)
    if last is not None and _holds(last, frame_refs):
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    result = getattr(shell, "last_execution_result", None)
    if result is not None and _holds(getattr(result, "error_in_exec", None), frame_refs):
        result.error_in_exec = None
    formatter = getattr(shell, "InteractiveTB", None)  # keeps the traceback for %debug
    if formatter is not None and _tb_holds(getattr(formatter, "tb", None), frame_refs):
        formatter.tb = None
    ns = getattr(shell, "user_ns", {})
    out = ns.get("Out")
    if isinstance(out, dict):
        for key in [k for k, v in out.items() if id(v) in value_refs]:
            del out[key]
    for name in [k for k, v in ns.items() if _is_output_variable(k) and id(v) in value_refs]:
        ns[name] = None
    hook = getattr(shell, "displayhook", None)
    for name in ("_", "__", "___"):
        if hook is not None and id(getattr(hook, name, None)) in value_refs:
            setattr(hook, name, None)


def _is_output_variable(name: str) -> bool:
    """IPython's output cache names: ``_``, ``__``, ``___``, ``_12``."""
    return name in ("_", "__", "___") or (name.startswith("_") and name[1:].isdigit())


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
