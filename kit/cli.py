"""``python -m kit train|eval|forward|scores|checkpoints CONFIG [key=value ...]``.

The same Engine methods as the notebook Session. Errors print one clear message and
exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import logging
import sys
from typing import Any

from kit.errors import KitError


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


def cmd_train(args: argparse.Namespace) -> int:
    from kit.engine.engine import Engine

    engine = Engine(_config(args))
    bar = _progress_bar(engine) if not args.quiet else None
    try:
        with bar.logging_redirected() if bar else contextlib.nullcontext():
            engine.train()
        main = engine.dist is None or engine.dist.is_main  # under torchrun, rank 0 reports
    finally:
        if bar:
            bar.close()
        engine.close()
    epochs = [e for e in engine.scores.epochs if engine.scores.has_scores(e)]
    if main and epochs:  # stdout: one line for scripts (the log on stderr says the same and more)
        last = epochs[-1]
        print(f"finished epoch {last}: " + ", ".join(f"{k} {v:.4g}" for k, v in engine.scores.scores(last).items()))
    return 0


def _progress_bar(engine: Any) -> Any:
    """A tqdm bar when a person watches (stdout and stderr are terminals); log lines alone otherwise."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return None
    from kit.widgets.terminal import TerminalProgress

    return TerminalProgress(engine.events, lambda: engine.final_epoch,
                            is_main=lambda: engine.dist is None or engine.dist.is_main)


def cmd_eval(args: argparse.Namespace) -> int:
    from kit.engine.engine import Engine

    engine = Engine(_config(args))
    engine.task = "eval"  # RETURNN: load / load_epoch choose the weights; preload entries for recog apply
    results = engine.eval_model()
    if not results:
        raise KitError(f"{args.config}: no eval datasets (set 'dev', 'eval' or 'eval_datasets')")
    for name, scores in results.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
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
    engine = Engine(config)
    engine.task = "forward"
    callback = config.typed_value("forward_callback")
    result = engine.forward(make_dataset(data), callback)
    if callback is None:
        arrays = {f"{tag}/{name}": arr for tag, outs in result.items() for name, arr in outs.items()}
        np.savez(args.output, **arrays)
        print(f"wrote outputs of {len(result)} sequences to {args.output}")
    engine.close()
    return 0


def cmd_scores(args: argparse.Namespace) -> int:
    from kit.scores import ScoreTable

    path = args.config
    if path.endswith(".py"):
        from kit.engine.parts import score_file_path

        path = score_file_path(_config(args))
    table = ScoreTable.load(path)
    print(table)
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from kit import checkpoints

    prefix = _config(args).typed_value("model")
    if not prefix:
        raise KitError(f"{args.config}: config key 'model' is not set")
    for ckpt in checkpoints.list_checkpoints(prefix):
        print(ckpt)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kit", description="kit: train, evaluate and forward from a config file")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in [("train", cmd_train, "train up to num_epochs (resumes automatically)"),
                           ("eval", cmd_eval, "evaluate the eval datasets"),
                           ("forward", cmd_forward, "run forward_step over forward_data"),
                           ("scores", cmd_scores, "print the score table (config or score file)"),
                           ("checkpoints", cmd_checkpoints, "list checkpoints")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="RETURNN-style Python config file")
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
