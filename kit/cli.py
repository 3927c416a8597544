"""``python -m kit train|eval|forward|scores|checkpoints CONFIG [key=value ...]``.

The same Engine methods as the notebook Session. Errors print one clear message and
exit non-zero; ``--debug`` shows the traceback.

``train`` stops cleanly on Ctrl-C (SIGINT), SIGTERM and SIGUSR1 (what SLURM sends before a
time limit or pre-emption, e.g. ``sbatch --signal=USR1@120``): the current step finishes, a
step checkpoint is written, a line on stderr says how to resume, and the exit status is
128 + the signal's number (130, 143, 138). The same command resumes bit-exactly. RETURNN's run tools stop it
too: ``torch_profile`` (exit status 0, nothing written) and ``stop_for_resubmission_when_low_time_left``
(a step checkpoint, SIGINT to the job's process group, exit status 1), see docs/run_tools.md. A second
Ctrl-C within a second stops at once, without saving. These handlers live only here: library
code installs none (the Session's own interrupt guard aside).

``python -m kit`` keeps SIGTERM and SIGUSR1 from killing the process at any instant once it runs
(:func:`install_process_handlers`): one that arrives before training stops the run there with the
same status (nothing trained, nothing lost); one that arrives after the last epoch's steps (e.g.
SLURM's SIGTERM a moment after its SIGUSR1, when the run has just finished) changes nothing: the
complete run exits 0. A stop's status names the first signal of a pair (SIGUSR1 then SIGTERM: 138).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kit.errors import ConfigError, KitError
from kit.scores import format_value

if TYPE_CHECKING:
    from kit.config import Config


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with value as a Python literal, else as a string."""
    if "=" not in text:
        raise KitError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip(), value


def _config(args: argparse.Namespace) -> Any:
    from kit.config import Config

    overrides = dict(parse_override(o) for o in args.overrides)
    return Config.from_file(args.config, **overrides)


# exit status after a stop by signal: 128 + its number, as a shell reports a process killed by it
RESUBMISSION = "low time left"  # kit.engine.resubmission.REASON (imported late: keeps the CLI's start fast)
STOP_SIGNALS = {"interrupt": ("SIGINT", 130), "SIGTERM": ("SIGTERM", 143), "SIGUSR1": ("SIGUSR1", 138),
                # a watcher's request (kit.attach(...).pause() / .stop()): as SIGUSR1
                "attach: pause": ("a pause request (kit.attach)", 138),
                "attach: stop": ("a stop request (kit.attach)", 138)}


_OUTSIDE_RUN: list[str] = []  # stop signals that arrived while no training listened (python -m kit only)


def install_process_handlers() -> None:
    """For the ``python -m kit`` process: SIGTERM / SIGUSR1 outside training are remembered, not fatal."""
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda signum, _frame: _OUTSIDE_RUN.append(signal.Signals(signum).name))


def block_stop_signals() -> None:
    """For the ``python -m kit`` process once its command returned: SIGTERM / SIGUSR1 stay pending until exit."""
    wanted = {getattr(signal, n) for n in ("SIGTERM", "SIGUSR1") if hasattr(signal, n)}
    if wanted and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, wanted)


def cmd_train(args: argparse.Namespace) -> int:
    """Train to ``num_epochs``; Ctrl-C, SIGTERM or SIGUSR1 stop at the next step boundary with a step checkpoint."""
    import time

    from kit.engine.engine import Engine
    from kit.session.interrupts import InterruptGuard

    engine = Engine(_config(args))
    guard = InterruptGuard()
    table = None
    event_log = None
    started, first_epoch = time.monotonic(), 1
    bar = _progress_bar(engine) if not args.quiet else None
    try:
        with guard.held(), _requests_on(guard, "SIGTERM", "SIGUSR1"):
            if _OUTSIDE_RUN:  # a stop signal before the run began: stop here, nothing trained or written
                name, status = STOP_SIGNALS.get(_OUTSIDE_RUN[0], (_OUTSIDE_RUN[0], 130))
                print(f"kit: stopped by {name} before training started; nothing was written", file=sys.stderr)
                return status
            engine.setup()
            if _nothing_to_do(engine):
                return 0
            from kit.eventlog import attach_to

            event_log = attach_to(engine, guard.request)  # {model}.events.jsonl, and kit.attach's requests
            first_epoch = engine.progress.epoch
            with _final_epoch_line_once(engine.final_epoch), \
                    bar.logging_redirected() if bar else contextlib.nullcontext():
                finished = engine.train(should_stop=lambda: guard.requested)
            main = engine.dist is None or engine.dist.is_main  # under torchrun, rank 0 reports
            table = engine.scores
            if not finished:
                return _stopped(engine, guard.reason or engine.stop_reason or "interrupt", args, main)
    finally:
        if bar:
            bar.close()
        if event_log is not None:
            event_log.close()
        engine.close()
    assert table is not None
    epochs = [e for e in table.epochs if table.has_scores(e)]
    if main and epochs:  # stdout: one line for scripts (the log on stderr leaves this one to it)
        last = epochs[-1]
        print(f"finished epoch {last}: " + ", ".join(f"{k} {format_value(v)}" for k, v in table.scores(last).items()))
        from kit.cli_views import train_summary

        print(train_summary(table, first_epoch, engine.config.typed_value("model"), time.monotonic() - started))
    return 0


def _progress_bar(engine: Any) -> Any:
    """A tqdm bar when a person watches (stdout and stderr are terminals); log lines alone otherwise."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return None
    from kit.widgets.terminal import TerminalProgress

    return TerminalProgress(engine.events, lambda: engine.final_epoch,
                            is_main=lambda: engine.dist is None or engine.dist.is_main)


@contextlib.contextmanager
def _requests_on(guard: Any, *names: str) -> Iterator[None]:
    """While training, the named signals ask ``guard`` to stop at the next step boundary (as Ctrl-C does)."""
    wanted = [getattr(signal, n) for n in names if hasattr(signal, n)]
    def request(signum: int, _frame: Any) -> None:
        if not guard.requested:  # the first signal of a pair (SLURM: SIGUSR1, then SIGTERM) names the stop
            guard.request(signal.Signals(signum).name)

    previous = {s: signal.signal(s, request) for s in wanted}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _nothing_to_do(engine: Any) -> bool:
    p = engine.progress
    if p.epoch_running or p.epoch <= engine.final_epoch:
        return False
    if engine.dist is None or engine.dist.is_main:
        print(f"already trained to epoch {p.epoch - 1} \u2265 num_epochs={engine.final_epoch}: nothing to do")
    return True


@contextlib.contextmanager
def _final_epoch_line_once(final_epoch: int) -> Iterator[None]:
    """The engine logs "finished epoch N" and the CLI prints the final one on stdout: show it once."""

    def not_the_final_line(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(f"finished epoch {final_epoch}:")

    handlers = logging.getLogger().handlers
    for h in handlers:
        h.addFilter(not_the_final_line)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(not_the_final_line)


def _stopped(engine: Any, reason: str, args: argparse.Namespace, main: bool) -> int:
    """After a stop by signal or run tool: a step checkpoint where the run stopped, a line saying how to resume.
    ``torch_profile`` (exit_after_profile) writes nothing and exits 0, as RETURNN; a stop for resubmission
    (low time left) signals the job's process group as RETURNN does and exits 1."""
    if reason == "torch_profile":
        if main:
            print("kit: stopped after torch profiling (torch_profile's exit_after_profile)", file=sys.stderr)
        return 0
    name, status = STOP_SIGNALS.get(reason, (reason, 130))
    if reason == RESUBMISSION:
        status = 1
    p = engine.progress
    saved = engine.last_checkpoint
    if engine.writes_files and (saved is None or saved.global_train_step != p.global_train_step):
        saved = engine.save_checkpoint(kind="step")
    if main:
        where = f"epoch {p.epoch}, step {p.step_in_epoch} (global step {p.global_train_step})"
        if saved is None:
            why = "dry_run is set" if engine.config.bool("dry_run") else "no 'model' set"
            print(f"kit: stopped by {name} at {where}; nothing saved ({why})", file=sys.stderr)
        else:
            again = " ".join(shlex.quote(a) for a in ["python", "-m", "kit", "train", args.config, *args.overrides])
            print(f"kit: stopped by {name} at {where}; saved {saved.name}. Resume with: {again}", file=sys.stderr)
    if reason == RESUBMISSION:
        _interrupt_job_group()
    return status


def _interrupt_job_group() -> None:
    """RETURNN's stop for resubmission: SIGINT to the process group of the job's worker (Sisyphus sees a
    cleanly interrupted job and resubmits it); under torchrun the parent's group. This process ignores it."""
    import os

    import torch.distributed

    if not hasattr(os, "getpgid"):  # not POSIX: nothing to signal
        return
    pgid = os.getpgid(os.getppid()) if torch.distributed.is_torchelastic_launched() else os.getpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.kill(-pgid, signal.SIGINT)


def _eval_epoch(config: Config) -> Config:
    """RETURNN's eval task: without ``load``, ``epoch`` names the checkpoint to evaluate (as ``load_epoch``,
    which must agree when both are set)."""
    epoch = config.typed_value("epoch")
    if epoch is None or config.typed_value("load"):
        return config
    load_epoch = config.typed_value("load_epoch")
    if load_epoch is not None and load_epoch != epoch:
        raise ConfigError(f"epoch {epoch} and load_epoch {load_epoch} have to match (RETURNN's eval task)")
    return config.update(load_epoch=epoch)


def cmd_eval(args: argparse.Namespace) -> int:
    from kit.engine.engine import Engine

    config = _eval_epoch(_config(args))
    engine = Engine(config, task="eval")  # RETURNN: load / load_epoch choose the weights; preload entries for recog apply
    results = engine.eval_model()
    if not results:
        raise KitError(f"{args.config}: no eval datasets (set 'dev', 'eval' or 'eval_datasets')")
    for name, scores in results.items():
        print(f"{name}: " + ", ".join(f"{k} {format_value(v)}" for k, v in scores.items()))
    engine.close()
    return 0


def cmd_forward(args: argparse.Namespace) -> int:
    import numpy as np

    from kit.data import make_dataset
    from kit.engine.engine import Engine

    config = _config(args)
    data = config.typed_value("forward_data") or config.typed_value("dev") or config.typed_value("eval")
    if data is None:
        raise KitError(f"{args.config}: set 'forward_data' (or 'dev') to the dataset to forward")
    engine = Engine(config, task="forward")
    callback = config.typed_value("forward_callback")
    result = engine.forward(make_dataset(data), callback)
    if callback is None:
        arrays = {f"{tag}/{name}": arr for tag, outs in result.items() for name, arr in outs.items()}
        np.savez(args.output, **arrays)
        print(f"wrote outputs of {len(result)} sequences to {args.output}")
    engine.close()
    return 0


_SCORE_SUFFIX = ".scores.json"


def _run_paths(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(model prefix, score file) of what the user named: a run folder, a config file, a model prefix or a
    score file."""
    what = args.config
    if os.path.isdir(what):  # a run folder: its one score file / checkpoint prefix
        from kit.cli_views import run_in_folder

        return run_in_folder(what)
    if what.endswith((".py", ".config")) or (os.path.isfile(what) and _looks_like_config(what)):
        from kit.engine.parts import score_file_path

        config = _config(args)
        return config.typed_value("model"), score_file_path(config)
    if what.endswith(_SCORE_SUFFIX):
        return what[: -len(_SCORE_SUFFIX)], what
    if os.path.isfile(what):  # another score file (e.g. RETURNN's learning_rate_file): no prefix in its name
        return None, what
    return what, what + _SCORE_SUFFIX  # a model prefix


def _looks_like_config(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(256).lstrip()
    return head.startswith(b"#!rnn.py") or head.startswith(b"#!/usr/bin/env") or head[:1] not in (b"{", b"")


def cmd_scores(args: argparse.Namespace) -> int:
    from kit.scores import ScoreTable

    _, path = _run_paths(args)
    if not path:
        raise KitError(f"{args.config}: no score file (set 'model' or 'learning_rate_file')")
    from kit.cli_views import scores_text

    if not os.path.exists(path):
        raise KitError(f"{args.config}: no score file {path!r} (name a run folder, a model prefix, a config or a "
                       f"score file)")
    print(scores_text(ScoreTable.load(path), path))
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from kit import checkpoints

    prefix, score_path = _run_paths(args)
    if not prefix:
        raise KitError(f"{args.config}: no model prefix (the config key 'model' is not set, or a score file "
                       f"not named <prefix>{_SCORE_SUFFIX})")
    from kit.cli_views import checkpoints_text
    from kit.scores import ScoreTable

    found = checkpoints.list_checkpoints(prefix)
    table = ScoreTable.load(score_path) if score_path and os.path.exists(score_path) else None
    print(checkpoints_text(found, table, prefix))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kit", description="kit: train, evaluate and forward from a config file")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in [("train", cmd_train, "train up to num_epochs (resumes automatically)"),
                           ("eval", cmd_eval, "evaluate the eval datasets"),
                           ("forward", cmd_forward, "run forward_step over forward_data"),
                           ("scores", cmd_scores, "print the score table (run folder, config, model prefix or score file)"),
                           ("checkpoints", cmd_checkpoints, "list checkpoints with sizes, verification and scores (run folder, config, model prefix or score file)")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="RETURNN-style Python config file" if name not in ("scores", "checkpoints")
                       else "a config file, a model prefix or a score file")
        p.add_argument("overrides", nargs="*", help="key=value (Python literal, else string)")
        if name == "forward":
            p.add_argument("--output", default="forward_outputs.npz", help="npz file when no forward_callback")
        p.set_defaults(fn=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("kit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        kind = "error" if isinstance(exc, KitError) else type(exc).__name__
        print(f"kit: {kind}: {exc}", file=sys.stderr)
        if not isinstance(exc, KitError):
            print("kit: run with --debug for the traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
