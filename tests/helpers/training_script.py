"""The training run of the resume and fault tests, in-process or as a subprocess to ``kill -9``.

``python tests/helpers/training_script.py PREFIX ['{"key": value, ...}']`` prints ``ready``
once imported, waits for a line on stdin (so a test can start it early and hide the import
time), trains :func:`config` (JSON overrides) to the end and prints ``step N`` (flushed)
after each train step, so that a test can kill it at a chosen point. ``KIT_TEST_STEP_DELAY``
(seconds) slows each step down, ``KIT_TEST_SLOW_WRITE_SECS`` (see helpers/slow_writes.py) each file write.

:func:`reference_run` is the uninterrupted run every resumed run is compared with.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: `helpers` importable

import torch  # noqa: E402
from helpers import slow_writes  # noqa: E402
from helpers.models import TinyModel, tiny_config  # noqa: E402

import kit  # noqa: E402
from kit.engine.engine import Engine  # noqa: E402

slow_writes.install()

NUM_EPOCHS = 2
STEPS_PER_EPOCH = 19  # 120 sequences, max_seqs=10, batch_size=600 (tiny_config)


def config(prefix: str | os.PathLike, **overrides: Any) -> kit.Config:
    """Dropout, ``random`` order, grad accumulation 2 (19 steps: the last window of an epoch
    is partial), a grad scaler that grows every 3 updates, a step checkpoint every 5 steps."""
    keys = dict(
        num_epochs=NUM_EPOCHS,
        accum_grad_multiple_step=2,
        save_every_n_steps=5,
        grad_scaler={"init_scale": 1024.0, "growth_interval": 3},
    )
    keys.update(overrides)
    return kit.Config(tiny_config(str(prefix), **keys))


@dataclass
class Recorder:
    """Per-step losses ``(global_train_step, ce, fer)`` of an engine, from its ``step_end`` events."""

    losses: list[tuple[int, float, float]] = field(default_factory=list)
    step_delay: float = 0.0
    echo: bool = False

    def attach(self, engine: Engine) -> Engine:
        engine.events.on("step_end", self.on_step_end)
        return engine

    def on_step_end(self, result: Any, **_: Any) -> None:
        losses = result.losses
        self.losses.append((result.global_train_step, losses["ce"], losses["fer"]))
        if self.echo:
            print(f"step {result.global_train_step}", flush=True)
        if self.step_delay:
            time.sleep(self.step_delay)


@dataclass
class RunResult:
    prefix: str
    losses: list[tuple[int, float, float]]
    state: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    scores: dict[int, dict[str, float]]


def snapshot(engine: Engine, losses: list[tuple[int, float, float]]) -> RunResult:
    return RunResult(
        prefix=str(engine.model_prefix),
        losses=list(losses),
        state={k: v.detach().clone() for k, v in engine.model.state_dict().items()},
        optimizer=copy.deepcopy(engine.optimizer.state_dict()),
        scaler=engine.compute.grad_scaler.state_dict() if engine.compute.grad_scaler is not None else None,
        scores={e: engine.scores.scores(e) for e in engine.scores.epochs},
    )


def train(
    prefix: str | os.PathLike, *, step_delay: float = 0.0, echo: bool = False, **overrides: Any
) -> RunResult:
    """Train :func:`config` (resuming from whatever is under ``prefix``) to the end."""
    recorder = Recorder(step_delay=step_delay, echo=echo)
    engine = recorder.attach(Engine(config(prefix, **overrides)))
    try:
        engine.train()
        return snapshot(engine, recorder.losses)
    finally:
        engine.close()


def copy_run(reference: RunResult, tmp_path: Path) -> str:
    """A copy of the reference run's files (checkpoints, score table); returns the new prefix."""
    shutil.copytree(os.path.dirname(reference.prefix), tmp_path / "run")
    return str(tmp_path / "run" / "model")


@functools.cache
def reference_run(root: str) -> RunResult:
    """The uninterrupted run (no data workers), once per test process; checkpoints stay under ``root``."""
    return train(Path(root) / "model")


def _warm_up() -> None:
    """What the first train step would pay for once (lazy imports, first autograd call), before ``ready``.

    Global RNG draws here do not matter: the engine seeds (or restores) every RNG itself.
    """
    import kit.data.pipeline  # noqa: F401
    import kit.engine.lr_control  # noqa: F401
    import kit.engine.updater  # noqa: F401

    model = TinyModel()
    torch.optim.Adam(model.parameters()).zero_grad()
    model(torch.zeros(1, 1, 9)).sum().backward()


def main(argv: list[str]) -> int:
    prefix = argv[1]
    overrides = json.loads(argv[2]) if len(argv) > 2 else {}
    torch.set_num_threads(1)
    _warm_up()
    print("ready", flush=True)
    sys.stdin.readline()
    train(prefix, step_delay=float(os.environ.get("KIT_TEST_STEP_DELAY", "0")), echo=True, **overrides)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
