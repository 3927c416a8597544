"""``session.train(processes=N)``: throughput of 2 workers against 1 process, start-up, per-call cost,
and what watching a CLI run (``kit.attach``'s event log) costs the run.

Run: ``python benchmarks/processes.py [--epochs 2] [--seqs 400] [--hidden 1024]``.

Compute-bound: a per-frame MLP (9 → hidden → hidden → hidden → 2) on Task12AX batches of 10
sequences (~600 frames), Adam; every process has one torch thread (the kernel's run sets
``torch.set_num_threads(1)``, the workers get ``threads // N``: run it with ``OMP_NUM_THREADS=2``
or more on a 2-core machine so that each of the 2 workers gets one). Throughput is the train
batches per second of a warm epoch (the second; the first includes the set-up), wall time.

* **start-up**: spawning the workers, importing torch and kit, joining the process group;
* **per call**: the wall time of ``train_steps(1, processes=2)`` minus one step's time (the
  state stays with the workers between calls; only the call and rank 0's state travel);
* **event log**: the CLI's :class:`kit.eventlog.EventLog` per step, off the log interval
  (the time check of its request polling), against one step of the tiny model of
  ``benchmarks/end_to_end.py``'s MLP case (~0.5 ms): must stay ≤ 1 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from report import Table, add_write_flag, publish

import kit
from kit.data import Task12AXDataset


class MLP(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(9, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                          torch.nn.Tanh(), torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                          torch.nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def train_step(*, model: torch.nn.Module, extern_data: Any, **_: Any) -> None:
    data, classes = extern_data["data"], extern_data["classes"]
    logits = model(data.tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
    kit.get_run_ctx().mark_as_loss(ce, "ce", mask=classes.mask())


def session(args: argparse.Namespace, folder: str) -> kit.Session:
    hidden = args.hidden
    return kit.Session(get_model=lambda **_: MLP(hidden), train_step=train_step,
                       extern_data=Task12AXDataset.extern_data,
                       train=Task12AXDataset(args.seqs, seed=1, seq_ordering="random"),
                       batch_size=100_000, max_seqs=10, optimizer={"class": "adam"}, learning_rate=1e-3,
                       num_epochs=args.epochs + 2, model=f"{folder}/model", live=False)


def throughput(s: kit.Session, processes: int, epochs: int) -> tuple[float, float]:
    """Batches per second of the warm epochs, and one rank's seconds per step."""
    s.train_epoch(processes=processes)  # set-up (and the workers' start)
    started = time.perf_counter()
    steps0 = s.progress.global_train_step
    for _ in range(epochs - 1):
        s.train_epoch(processes=processes)
    seconds = time.perf_counter() - started
    steps = s.progress.global_train_step - steps0
    return steps * processes / seconds, seconds / steps


def event_log_cost() -> float:
    """Seconds per step the CLI's event log adds off its log interval."""
    from kit.eventlog import EventLog

    class Result:  # a step off the log interval (the first call opens the log: one line in 200,000 calls)
        epoch, step, global_train_step, learning_rate, seconds, losses = 1, 1, 1, 0.01, 0.001, {"ce": 1.0}

    with tempfile.TemporaryDirectory() as folder:
        log = EventLog(f"{folder}/model", log_every=100, request=lambda reason: None)
        result, n = Result(), 200_000
        started = time.perf_counter()
        for _ in range(n):
            log.on_step_end(result)
        cost = (time.perf_counter() - started) / n
        log.close()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2, help="epochs timed per run (the first is a warm-up)")
    parser.add_argument("--seqs", type=int, default=400, help="train sequences (10 per batch)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=5, help="one-step calls timed for the per-call cost")
    add_write_flag(parser)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the single process: one thread, as each worker
    with tempfile.TemporaryDirectory() as folder:
        with session(args, f"{folder}/one") as one:
            single, _ = throughput(one, 1, args.epochs + 1)
        torch.set_num_threads(threads)  # the workers get threads // 2 each
        with session(args, f"{folder}/two") as two:
            double, _ = throughput(two, 2, args.epochs + 1)
            startup = kit.multiproc.startup_secs(two) or float("nan")
            calls, steps = [], []
            for _ in range(args.calls):
                started = time.perf_counter()
                result = two.train_steps(1, processes=2)
                calls.append(time.perf_counter() - started)
                steps.append(result.last_step.seconds if result.last_step is not None else 0.0)
    per_call = statistics.median(c - s for c, s in zip(calls, steps))
    step_secs = statistics.median(steps)
    log = event_log_cost()
    print(f"throughput, 1 process: {single:.2f} batches/s; 2 workers: {double:.2f} batches/s "
          f"({double / single:.2f}x; hidden {args.hidden}, {args.seqs // 10} batches per epoch)")
    print(f"worker start-up: {startup:.1f} s; per call: {per_call * 1e3:.0f} ms over one step's {step_secs * 1e3:.0f} ms")
    print(f"event log per step: {log * 1e6:.2f} µs ({log / 0.5e-3:.2%} of a 0.5 ms step)")
    table = Table("measure", "value", "target")
    table.add("throughput, 2 workers / 1 process", f"{double / single:.2f}x ({double:.2f} vs {single:.2f} batches/s)",
              ">= 1.7x")
    table.add("worker start-up", f"{startup:.1f} s", "")
    table.add("per call, beyond its step", f"{per_call * 1e3:.0f} ms (one step: {step_secs * 1e3:.0f} ms)", "")
    table.add("event log, per step of a CLI run", f"{log * 1e6:.2f} µs", "<= 1 % of a step")
    publish(args, "processes", table, notes=f"MLP hidden {args.hidden}, {args.seqs // 10} batches per epoch, "
            f"{args.epochs} timed epochs; the single process with one torch thread, each worker with its share")


if __name__ == "__main__":
    main()
