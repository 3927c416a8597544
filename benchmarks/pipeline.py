"""Data pipeline throughput and padding efficiency.

Run: ``python benchmarks/pipeline.py`` (about a minute on 2 cores).

Data: 20k sequences with log-normal lengths (skewed: many short, a long tail), 40-dim
float32 features plus sparse int64 labels per frame, in memory (ArrayDataset).

1. Throughput, sequences/s over one epoch (``laplace:.100`` order, batch_size=20000
   frames, max_seqs=256), measured interleaved, median of repeats:
   kit Pipeline with 0 and 2 workers (planning, extern_data validation and padding
   included) vs a plain ``torch.utils.data.DataLoader`` over the same data with the
   same batches (``batch_sampler`` = kit's plan) and a ``pad_sequence`` collate.
2. Padding efficiency (real frames / padded frames) of the planned batches for the
   orderings ``random``, ``laplace:.100``, ``laplace:.1000`` and ``sorted``, over batch
   sizes: laplace only helps when a bin (``.S`` = S seqs) holds many batches; with
   ~250 seqs per batch a bin of 100 is smaller than one batch. The last lines check the
   target (laplace >= 0.9 where random gives far less) per laplace ordering, with how
   many batches one bin holds: about 15 or more are needed on this (skewed) data.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.utils.data
from report import Table, add_write_flag, publish
from torch.nn.utils.rnn import pad_sequence

from kit.data import ArrayDataset, Pipeline

FEATURES = 40
EXTERN_DATA = {"data": {"shape": (None, FEATURES)}, "classes": {"shape": (None,), "sparse_dim": 100}}


def make_dataset(num_seqs: int, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(mean=3.8, sigma=0.9, size=num_seqs), 2, 2000).astype(int)
    seqs = [
        {
            "data": rng.standard_normal((t, FEATURES), dtype=np.float32),
            "classes": rng.integers(0, 100, size=t),
        }
        for t in lens
    ]
    return ArrayDataset(seqs, seq_ordering="laplace:.100")


class PlainDataset(torch.utils.data.Dataset):
    """What a user would write without kit: tensors per item."""

    def __init__(self, ds: ArrayDataset):
        self.seqs = [ds.get_seq(i) for i in range(len(ds))]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.seqs[i]
        return {"data": torch.from_numpy(s["data"]), "classes": torch.from_numpy(s["classes"])}


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for key in items[0]:
        tensors = [x[key] for x in items]
        out[key] = pad_sequence(tensors, batch_first=True)
        out[key + ":lengths"] = torch.tensor([len(t) for t in tensors], dtype=torch.int32)
    return out


def run_kit(ds: ArrayDataset, workers: int, pipe_cache: dict) -> float:
    pipe = pipe_cache.get(workers)
    if pipe is None:  # workers start once, as in training (persistent)
        pipe = pipe_cache[workers] = Pipeline(
            ds, extern_data=EXTERN_DATA, batch_size=20000, max_seqs=256, num_workers=workers
        )
    t0 = time.perf_counter()
    pipe.set_epoch(1)
    n = sum(b.num_seqs for b in pipe)
    return n / (time.perf_counter() - t0)


def run_plain(loader: torch.utils.data.DataLoader) -> float:
    t0 = time.perf_counter()
    n = sum(b["data"].shape[0] for b in loader)
    return n / (time.perf_counter() - t0)


def padding_efficiency(ds: ArrayDataset, ordering: str, batch_size: int) -> tuple[float, float]:
    """(real / padded frames, mean seqs per batch) of the planned batches."""
    pipe = Pipeline(ds, batch_size=batch_size, max_seqs=256, seq_ordering=ordering)
    pipe.set_epoch(1)
    lens = ds.seq_lengths()["data"]
    real = padded = 0
    plan = pipe.plan()
    for entries in plan:
        t = lens[[i for i, _ in entries]]
        real += int(t.sum())
        padded += int(t.max()) * len(t)
    return real / padded, len(ds) / len(plan)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    add_write_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    ds = make_dataset(args.num_seqs)
    lens = ds.seq_lengths()["data"]
    print(
        f"dataset: {len(ds)} seqs, lengths median {int(np.median(lens))}, mean {lens.mean():.0f}, "
        f"max {lens.max()}, {FEATURES}-dim float32 ({time.perf_counter() - t0:.1f}s to build)"
    )

    plan_pipe = Pipeline(ds, batch_size=20000, max_seqs=256)
    plan_pipe.set_epoch(1)
    plan = [[i for i, _ in entries] for entries in plan_pipe.plan()]
    plain = PlainDataset(ds)
    loaders = {
        w: torch.utils.data.DataLoader(
            plain, batch_sampler=plan, collate_fn=pad_collate, num_workers=w, persistent_workers=w > 0
        )
        for w in (0, 2)
    }
    runs: dict[str, list[float]] = {k: [] for k in ("kit 0w", "kit 2w", "plain 0w", "plain 2w")}
    cache: dict = {}
    run_kit(ds, 0, cache), run_kit(ds, 2, cache), run_plain(loaders[0]), run_plain(loaders[2])  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift hits all alike
        runs["kit 0w"].append(run_kit(ds, 0, cache))
        runs["plain 0w"].append(run_plain(loaders[0]))
        runs["kit 2w"].append(run_kit(ds, 2, cache))
        runs["plain 2w"].append(run_plain(loaders[2]))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\nthroughput, sequences/s (median of {args.repeats}, {len(plan)} batches per epoch):")
    for k, v in med.items():
        print(f"  {k:10s} {v:10.0f}")
    print(f"  ratio kit/plain, 0 workers: {med['kit 0w'] / med['plain 0w']:.2f}")
    print(f"  ratio kit/plain, 2 workers: {med['kit 2w'] / med['plain 2w']:.2f}")
    print(f"  ratio kit 2 workers / plain 0 workers: {med['kit 2w'] / med['plain 0w']:.2f}")
    for pipe in cache.values():
        pipe.close()

    print("\npadding efficiency (real / padded frames), max_seqs=256; seqs/batch in brackets:")
    orderings = ("random", "laplace:.100", "laplace:.1000", "sorted")
    print("  batch_size " + "".join(f"{o:>20s}" for o in orderings))
    table = {}
    for batch_size in (500, 1000, 2000, 5000, 20000):
        table[batch_size] = {o: padding_efficiency(ds, o, batch_size) for o in orderings}
        cells = [f"{eff:.3f} ({per_batch:5.1f})" for eff, per_batch in table[batch_size].values()]
        print(f"  {batch_size:10d} " + "".join(f"{c:>20s}" for c in cells))
    print("target, laplace >= 0.9 where random gives far less:")
    for ordering in ("laplace:.100", "laplace:.1000"):
        bin_size = int(ordering.split(".")[1])
        met = [(b, row[ordering], row["random"][0]) for b, row in table.items() if row[ordering][0] >= 0.9]
        if not met:
            print(f"  {ordering}: not met at any batch size above")
            continue
        b, (eff, per_batch), random_eff = max(met)  # the largest batch size that meets it
        print(
            f"  {ordering}: met up to batch_size {b} ({eff:.3f} vs random {random_eff:.3f}; "
            f"{per_batch:.1f} seqs per batch, a bin holds {bin_size / per_batch:.0f} batches)"
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    throughput = Table("loader", "sequences/s, median", "ratio to plain, same workers")
    for k, v in med.items():
        throughput.add(k, f"{v:.0f}", f"{v / med['plain ' + k.split()[1]]:.2f}")
    padding = Table("batch_size", *orderings)
    for batch_size, row in table.items():
        padding.add(batch_size, *(f"{eff:.3f} ({per_batch:.1f})" for eff, per_batch in row.values()))
    publish(args, "pipeline", throughput.markdown() + "\n\nPadding efficiency (real / padded frames; sequences "
            "per batch in brackets), max_seqs=256:\n\n" + padding.markdown(),
            notes=f"{len(ds)} sequences, {len(plan)} batches per epoch, median of {args.repeats} interleaved epochs; "
                  "plain: a `DataLoader` with kit's batch plan as its `batch_sampler` and a `pad_sequence` collate.")


if __name__ == "__main__":
    main()
