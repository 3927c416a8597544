"""End to end per step: per-sequence data through ``kit.Session.train_steps`` vs hand-written loops.

Run: ``python benchmarks/end_to_end.py [--only mlp|transformer] [--rounds N] [--profile]``.

What users run: a dataset of per-sequence dicts goes through kit's pipeline (order, batch
plan, validation against ``extern_data``, padding) every step. Measured against

* **loop, pre-collated**: a hand-written loop over padded tensors built once before timing
  (the floor: no data work at all);
* **loop + DataLoader**: the same loop fed by a plain ``torch.utils.data.DataLoader`` over
  a map-style torch dataset of per-sequence tensors, ``batch_sampler`` = kit's plan,
  ``pad_sequence`` collate, 0 workers;
* **loop + per-item collate**: the same loop, each batch collated in turn from the same torch
  dataset's items with the same ``pad_sequence`` collate, no DataLoader: the least a training
  loop over per-item data does each step (the floor of a ``TorchDataset``, whose items kit reads
  one by one too);
* **kit**: ``Session.train_steps(k)`` over an ``ArrayDataset`` of dicts and over a
  ``TorchDataset`` wrapping that torch dataset, with defaults (the non-finite guard on)
  and with ``stop_on_nonfinite_train_score=False``.

Everyone gets the same model and initial weights, the same batches in the same order, the
same masked frame-CE sum and ``torch.optim.AdamW``; they end on bitwise identical weights
(checked and printed). Runs are interleaved in one process — every variant takes a turn of
``k`` steps per round — and timed in process CPU time with one torch thread, which other
load on a shared machine disturbs far less than wall time. Printed: the median per-round
ratio to the pre-collated loop, with its interquartile range, "+µs": the median extra
host time per step over that loop, and "totals": the ratio of all the time of all rounds
(periodic work, such as a block of batches gathered every ~60 steps, falls into some turns
only: the median of turns leaves part of it out, the totals count all of it).

Workloads: (a) a 2-layer MLP 128→256→256→10 on 64 length-1 sequences per batch, where
per-step host work dominates (targets: kit defaults ≤ 1.10, guard off ≤ 1.05, with kit's own
data path, an ``ArrayDataset``; a ``TorchDataset`` is read item by item through the user's
``__getitem__``, whose cost no data path can take off, so its target there is to stay below
the per-item loop);
(b) a 4-layer Transformer encoder (d_model 128) on batches of 8 sequences of 20–70
frames, compute-bound (target ≤ 1.02 for both datasets).

Rounds: 240 on the MLP (~1.5 min), 120 on the Transformer (~3 min). A round's ratio spreads
±5–8 % on this 2-core machine, so a median of 80 rounds still moves by ±0.01–0.02 between
runs — about kit's whole overhead with the guard off; three times the rounds halve that.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import itertools
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data
from report import Table, add_write_flag, publish
from torch.nn.utils.rnn import pad_sequence

import kit
from kit.data import ArrayDataset, TorchDataset, batches

CLOCK = time.process_time


# ---- the two workloads ------------------------------------------------------------------


class MLP(torch.nn.Module):
    """Per frame 128→256→256→10."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Transformer(torch.nn.Module):
    """40-dim features → 4 encoder layers, d_model 128, 4 heads → 10 classes per frame."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(40, 128)
        layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.out = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x), src_key_padding_mask=~mask))


@dataclass
class Workload:
    name: str
    make_model: Callable[[], torch.nn.Module]
    features: int
    min_len: int
    max_len: int
    num_seqs: int  # one epoch
    max_seqs: int  # sequences per batch
    turn: int  # steps per variant and round
    rounds: int
    targets: dict[str, float]
    per_item_floor: bool = False  # a TorchDataset's target: below the per-item loop (else the targets above)


WORKLOADS = {
    "mlp": Workload("(a) MLP 128-256-256-10, 64 length-1 seqs per batch", MLP, 128, 1, 1, 64 * 400, 64,
                    20, 240, {"guard on": 1.10, "guard off": 1.05}, per_item_floor=True),
    "transformer": Workload("(b) Transformer 4x128, 8 seqs of 20-70 frames per batch", Transformer, 40,
                            20, 70, 8 * 100, 8, 4, 120, {"guard on": 1.02, "guard off": 1.02}),
}

EXTERN_DATA = {"classes": {"shape": (None,), "sparse_dim": 10}}


def extern_data(w: Workload) -> dict[str, Any]:
    return {"data": {"shape": (None, w.features)}, **EXTERN_DATA}


def make_seqs(w: Workload, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(w.min_len, w.max_len + 1, size=w.num_seqs)
    return [
        {"data": rng.standard_normal((t, w.features), dtype=np.float32), "classes": rng.integers(0, 10, t)}
        for t in lens
    ]


class SeqTensors(torch.utils.data.Dataset):
    """What one writes without kit: a map-style dataset of per-sequence tensors."""

    def __init__(self, seqs: list[dict[str, np.ndarray]]):
        self.seqs = [{k: torch.from_numpy(v) for k, v in s.items()} for s in seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.seqs[i]


def pad_collate(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data [B, T, F], classes [B, T], lengths [B]) zero-padded."""
    lengths = torch.tensor([len(x["classes"]) for x in items], dtype=torch.int32)
    data = pad_sequence([x["data"] for x in items], batch_first=True)
    classes = pad_sequence([x["classes"] for x in items], batch_first=True)
    return data, classes, lengths


def frame_ce(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(x, mask)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")


def length_mask(lengths: torch.Tensor, time: int) -> torch.Tensor:
    return torch.arange(time)[None, :] < lengths[:, None]


def kit_train_step(*, model: torch.nn.Module, extern_data: kit.Batch, **_: Any) -> None:
    data, classes = extern_data["data"], extern_data["classes"]
    mask = classes.mask()
    ce = frame_ce(model, data.tensor, classes.tensor, mask)
    kit.get_run_ctx().mark_as_loss(ce, "ce", mask=mask)  # sum over real frames, as the loops


def plan_indices(seqs: list[dict[str, np.ndarray]], w: Workload) -> list[list[int]]:
    """kit's batch plan of one epoch as lists of sequence indices (every variant's batches)."""
    pipe = batches(ArrayDataset(seqs), extern_data=extern_data(w), batch_size=10**9, max_seqs=w.max_seqs)
    return [[i for i, _ in entries] for entries in pipe.plan()]


# ---- the contenders ---------------------------------------------------------------------


class HandLoop:
    """zero_grad, forward, masked CE sum, backward, AdamW step; loss and frame totals on the device
    (what a loop reporting the loss per frame keeps, as kit does)."""

    def __init__(self, model: torch.nn.Module, batch_iter: Iterator[tuple[torch.Tensor, ...]]):
        self.model, self.batches = model, batch_iter
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.frames = torch.zeros((), dtype=torch.int64)

    def run(self, steps: int) -> None:
        model, opt = self.model, self.opt
        for _ in range(steps):
            x, y, mask = next(self.batches)
            opt.zero_grad(set_to_none=True)
            loss = torch.where(mask, frame_ce(model, x, y, mask), 0).sum()
            loss.backward()
            opt.step()
            self.loss_sum += loss.detach()
            self.frames += mask.sum()


def precollated(seqs: list[dict[str, np.ndarray]], plan: list[list[int]]) -> Iterator[tuple[torch.Tensor, ...]]:
    items = SeqTensors(seqs)
    ready = []
    for idx in plan:
        x, y, lengths = pad_collate([items[i] for i in idx])
        ready.append((x, y, length_mask(lengths, y.shape[1])))
    return itertools.cycle(ready)


def per_item_batches(dataset: SeqTensors, plan: list[list[int]]) -> Iterator[tuple[torch.Tensor, ...]]:
    while True:
        for idx in plan:
            x, y, lengths = pad_collate([dataset[i] for i in idx])
            yield x, y, length_mask(lengths, y.shape[1])


def dataloader_batches(dataset: SeqTensors, plan: list[list[int]]) -> Iterator[tuple[torch.Tensor, ...]]:
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=plan, collate_fn=pad_collate, num_workers=0)
    while True:  # epoch after epoch, as a training loop does
        for x, y, lengths in loader:
            yield x, y, length_mask(lengths, y.shape[1])


class KitRun:
    """``Session.train_steps(k)``: the whole of kit per step (pipeline, step, history, events)."""

    def __init__(self, model: torch.nn.Module, dataset: Any, w: Workload, guard: bool):
        self.session = kit.Session(
            get_model=lambda **_: model,
            train_step=kit_train_step,
            train=dataset,
            extern_data=extern_data(w),
            batch_size=10**9,
            max_seqs=w.max_seqs,
            optimizer={"class": "adamw"},
            learning_rate=1e-3,
            num_epochs=10**6,
            device="cpu",
            **({} if guard else {"stop_on_nonfinite_train_score": False}),
        )
        self.model = model

    def run(self, steps: int) -> None:
        self.session.train_steps(steps)


def contenders(w: Workload) -> dict[str, Any]:
    seqs = make_seqs(w)
    plan = plan_indices(seqs, w)
    torch.manual_seed(0)
    base = w.make_model()
    torch_items = SeqTensors(seqs)
    return {
        "loop, pre-collated": HandLoop(copy.deepcopy(base), precollated(seqs, plan)),
        "loop + per-item collate": HandLoop(copy.deepcopy(base), per_item_batches(torch_items, plan)),
        "loop + DataLoader": HandLoop(copy.deepcopy(base), dataloader_batches(torch_items, plan)),
        "kit ArrayDataset, guard on": KitRun(copy.deepcopy(base), ArrayDataset(seqs), w, guard=True),
        "kit ArrayDataset, guard off": KitRun(copy.deepcopy(base), ArrayDataset(seqs), w, guard=False),
        "kit TorchDataset, guard on": KitRun(copy.deepcopy(base), TorchDataset(torch_items), w, guard=True),
        "kit TorchDataset, guard off": KitRun(copy.deepcopy(base), TorchDataset(torch_items), w, guard=False),
    }


# ---- timing -----------------------------------------------------------------------------


def timed(fn: Callable[[], None]) -> float:
    t = CLOCK()
    fn()
    return CLOCK() - t


def interleave(runs: dict[str, Any], turn: int, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step of every variant in every round; all take a turn of ``turn`` steps per round."""
    for run in runs.values():  # allocator, optimizer state, the epoch's plan: outside the timing
        run.run(warmup)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        order = list(runs.items())
        if r % 2:  # who goes first alternates, so a cache warmed by the previous turn favours no one
            order.reverse()
        for name, run in order:
            times[name].append(timed(lambda run=run: run.run(turn)) / turn)
    return times


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> str:
    with torch.no_grad():
        diffs = [float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters())]
    worst = max(diffs)
    return "identical" if worst == 0 else f"max diff {worst:.1e}"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, statistics.median(values), q3


def ratios_to(times: dict[str, list[float]], base: str) -> dict[str, tuple[float, float, float]]:
    return {k: quartiles([t / b for t, b in zip(v, times[base])]) for k, v in times.items()}


def report(w: Workload, runs: dict[str, Any], times: dict[str, list[float]], base: str,
           table: Table | None = None) -> dict[str, float]:
    ratios = ratios_to(times, base)
    print(f"\n{w.name}: {w.turn} steps per turn, {len(times[base])} rounds")
    print(f"  {'variant':<30} {'µs/step':>8} {'+µs':>6} {'ratio':>6}  {'interquartile':<13} {'totals':>6}  "
          f"{'weights':<17} target")
    for name, vals in times.items():
        q1, med, q3 = ratios[name]
        extra = statistics.median(t - b for t, b in zip(vals, times[base])) * 1e6  # per round, as the ratio
        target = next((t for key, t in w.targets.items() if name.startswith("kit") and key in name), None)
        floor = "loop + per-item collate"
        if w.per_item_floor and "TorchDataset" in name and floor in ratios:
            verdict = f"< per-item loop {'ok' if med < ratios[floor][1] else 'MISSED'}"
        else:
            verdict = "" if target is None else f"≤ {target:.2f} {'ok' if med <= target else 'MISSED'}"
        weights = "" if name == base else same_weights(runs[base].model, runs[name].model)
        totals = sum(vals) / sum(times[base])  # every step counted: what a median of turns leaves out
        print(f"  {name:<30} {statistics.median(vals) * 1e6:8.0f} {extra:6.0f} {med:6.3f}  {q1:5.3f}-{q3:5.3f}   "
              f"{totals:6.3f}  {weights:<17} {verdict}")
        if table is not None:
            table.add(name, f"{statistics.median(vals) * 1e6:.0f}", f"{extra:.0f}", f"{med:.3f}×",
                      f"{q1:.3f}–{q3:.3f}", f"{totals:.3f}", weights, verdict)
    print("  (totals: all of a variant's time over all of the loop's. Work that comes every so many steps —\n"
          "   a block of batches gathered, the history read, an epoch's end — falls into some turns only,\n"
          "   so the median of turns leaves part of it out; the totals count it, and other load on the machine too.)")
    return {k: v[1] for k, v in ratios.items()}


def profile(w: Workload, steps: int) -> None:
    """cProfile kit (ArrayDataset, defaults) through Session.train_steps."""
    run = contenders(w)["kit ArrayDataset, guard on"]
    run.run(3)
    prof = cProfile.Profile()
    prof.runcall(run.run, steps)
    print(f"\ncProfile of {steps} kit steps, {w.name}:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, help="rounds per workload (default: the workload's)")
    ap.add_argument("--turn", type=int, help="steps per variant and round, i.e. per train_steps call of kit's "
                    "(default: the workload's; kit pays its per-call cost, the RNG swap and set-up, once a turn)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="time wall clock instead of process CPU time")
    ap.add_argument("--profile", type=int, metavar="STEPS", help="cProfile STEPS kit steps instead of timing")
    add_write_flag(ap)
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.process_time
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU, "
          f"{'wall clock' if args.wall else 'process CPU time'}; interleaved turns, medians of per-round ratios")
    for key, w in WORKLOADS.items():
        if args.only not in (None, key):
            continue
        if args.profile:
            profile(w, args.profile)
            continue
        if args.turn:
            w = dataclasses.replace(w, turn=args.turn)
        runs = contenders(w)
        times = interleave(runs, w.turn, args.rounds or w.rounds)
        table = Table("variant", "µs/step", "+µs", "ratio", "interquartile", "totals", "weights", "target")
        report(w, runs, times, "loop, pre-collated", table)
        publish(args, f"end_to_end.{key}", table, notes=(
            f"{w.name}: {w.turn} steps per turn, {len(times['loop, pre-collated'])} rounds, "
            f"{'wall clock' if args.wall else 'process CPU time'}, {args.threads} torch thread(s). Ratio: median "
            "of per-round ratios to the pre-collated loop; +µs: median extra host time per step; totals: all of a "
            "variant's time over all of the loop's (work that comes every so many steps included)."))


if __name__ == "__main__":
    main()
