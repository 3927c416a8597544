"""``session.train(processes=N)``: throughput of 2 workers against 1 process, start-up, per-call cost,
and what watching a CLI run (``kit.attach``'s event log) costs the run.

Run: ``python benchmarks/processes.py [--epochs 2] [--batches 40] [--max-seqs 40,10] [--hidden 1024]``.

A per-frame MLP (9 → hidden → hidden → hidden → 2, 2.1M parameters at hidden 1024) on Task12AX
sequences, Adam, batches of ``--max-seqs`` sequences in RETURNN's usual training order
(``laplace``: neighbouring batches of similar length, so the ranks' steps take similar time).
Compute-bound means the step's arithmetic dominates its gradient all-reduce: at 40 sequences
(~2,400 frames) per batch the all-reduce of 8 MB is a few percent of a step; at 10 (~600 frames)
it is several times larger in proportion — both are printed, so the dependence shows, each beside a
plain torch loop (the same MLP under ``DistributedDataParallel`` on gloo, no kit) on as many frames:
what the machine and gloo's all-reduce allow. Every
process has one torch thread (the kernel's run sets ``torch.set_num_threads(1)``, the workers get
``threads // N``: run it with ``OMP_NUM_THREADS=2`` or more on a 2-core machine so that each of
the 2 workers gets one). Throughput is the train batches per second of the warm epochs (the
first epoch, with the set-up and the workers' start, is not timed), wall time.

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


def session(args: argparse.Namespace, folder: str, max_seqs: int) -> kit.Session:
    hidden = args.hidden
    return kit.Session(get_model=lambda **_: MLP(hidden), train_step=train_step,
                       extern_data=Task12AXDataset.extern_data,
                       train=Task12AXDataset(args.batches * max_seqs, seed=1, seq_ordering=f"laplace:.{max_seqs}"),
                       batch_size=100_000, max_seqs=max_seqs, optimizer={"class": "adam"}, learning_rate=1e-3,
                       num_epochs=args.epochs + 3, model=f"{folder}/model", live=False)


def epoch_secs(s: kit.Session, processes: int) -> tuple[float, int]:
    """Wall seconds of one train_epoch call, and the batches it trained (all ranks)."""
    steps0 = s.progress.global_train_step
    started = time.perf_counter()
    s.train_epoch(processes=processes)
    return time.perf_counter() - started, (s.progress.global_train_step - steps0) * processes


def throughput(args: argparse.Namespace, folder: str, max_seqs: int) -> tuple[float, float, kit.Session]:
    """Batches per second of 1 process and of 2 workers, their warm epochs interleaved (a change of the
    machine's load hits both alike); the 2-worker session is returned open (for the per-call cost)."""
    threads = torch.get_num_threads()
    two = session(args, f"{folder}/two-{max_seqs}", max_seqs)
    two.train_epoch(processes=2)  # set-up, the workers' start (each gets threads // 2)
    torch.set_num_threads(1)  # the single process: one thread, as each worker
    try:
        with session(args, f"{folder}/one-{max_seqs}", max_seqs) as one:
            one.train_epoch(processes=1)
            totals = {1: [0.0, 0], 2: [0.0, 0]}
            for _ in range(args.epochs):
                for n, s in ((1, one), (2, two)):
                    secs, batches = epoch_secs(s, n)
                    totals[n][0] += secs
                    totals[n][1] += batches
    finally:
        torch.set_num_threads(threads)
    return totals[1][1] / totals[1][0], totals[2][1] / totals[2][0], two


def _plain_rank(rank: int, world: int, port: int, hidden: int, frames: int, steps: int, out: Any) -> None:
    """One process of the plain torch loop: the same MLP, Adam, ``frames`` frames a step; DDP over gloo when
    ``world`` > 1. Puts its seconds per step."""
    import os

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model: torch.nn.Module = MLP(hidden)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    x, y = torch.randn(frames, 9), torch.randint(0, 2, (frames,))
    for i in range(steps + 2):  # two warm-up steps
        if i == 2:
            started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    out.put((time.perf_counter() - started) / steps)
    if world > 1:
        torch.distributed.destroy_process_group()


def plain_ddp_ratio(hidden: int, frames: int, steps: int = 20) -> float:
    """Throughput of 2 plain DDP processes over 1 plain process (torch alone: what the machine and gloo allow)."""
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    secs = {}
    for world in (1, 2):
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.Queue()
        procs = [ctx.Process(target=_plain_rank, args=(r, world, port, hidden, frames, steps, out)) for r in range(world)]
        for p in procs:
            p.start()
        secs[world] = max(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return 2 * secs[1] / secs[2]


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
    parser.add_argument("--epochs", type=int, default=2, help="epochs timed per run (after an untimed one)")
    parser.add_argument("--batches", type=int, default=40, help="train batches per epoch")
    parser.add_argument("--max-seqs", default="40,10", help="sequences per batch, one row each (comma-separated)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=5, help="one-step calls timed for the per-call cost")
    add_write_flag(parser)
    args = parser.parse_args()
    table = Table("measure", "value", "target")
    with tempfile.TemporaryDirectory() as folder:
        for i, max_seqs in enumerate(int(v) for v in args.max_seqs.split(",")):
            single, double, two = throughput(args, folder, max_seqs)
            with two:
                print(f"throughput, {max_seqs} seqs per batch: 1 process {single:.2f} batches/s; 2 workers "
                      f"{double:.2f} batches/s ({double / single:.2f}x)")
                table.add(f"throughput, 2 workers / 1 process, {max_seqs} seqs per batch",
                          f"{double / single:.2f}x ({double:.2f} vs {single:.2f} batches/s)",
                          ">= 1.7x" if i == 0 else "")
                if i == 0:
                    per_call_rows(two, args, table)
            frames = 60 * max_seqs  # Task12AX sequences are ~60 frames long
            plain = plain_ddp_ratio(args.hidden, frames)
            print(f"plain torch DDP (gloo), {frames} frames a step: 2 processes / 1 = {plain:.2f}x")
            table.add(f"the same with a plain torch DDP loop, {frames} frames a step", f"{plain:.2f}x", "")
    log = event_log_cost()
    print(f"event log per step: {log * 1e6:.2f} µs ({log / 0.5e-3:.2%} of a 0.5 ms step)")
    table.add("event log, per step of a CLI run", f"{log * 1e6:.2f} µs", "<= 1 % of a step")
    publish(args, "processes", table, notes=f"MLP hidden {args.hidden}, {args.batches} batches per epoch, "
            f"{args.epochs} timed epochs each, interleaved; the single process with one torch thread, each "
            "worker with its share")


def per_call_rows(two: kit.Session, args: argparse.Namespace, table: Table) -> None:
    """Worker start-up, and what a call costs beyond its one step (the state stays with the workers)."""
    startup = kit.multiproc.startup_secs(two) or float("nan")
    calls, steps = [], []
    for _ in range(args.calls):
        started = time.perf_counter()
        result = two.train_steps(1, processes=2)
        calls.append(time.perf_counter() - started)
        steps.append(result.last_step.seconds if result.last_step is not None else 0.0)
    per_call, step_secs = statistics.median(c - s for c, s in zip(calls, steps)), statistics.median(steps)
    print(f"worker start-up: {startup:.1f} s; per call: {per_call * 1e3:.0f} ms over one step's {step_secs * 1e3:.0f} ms")
    table.add("worker start-up", f"{startup:.1f} s", "")
    table.add("per call, beyond its step", f"{per_call * 1e3:.0f} ms (one step: {step_secs * 1e3:.0f} ms)", "")


if __name__ == "__main__":
    main()
