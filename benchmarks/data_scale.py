"""Data off the critical path: training through kit's pipeline on HDF files against batches in memory.

Run: ``python benchmarks/data_scale.py`` (about 10 minutes on 2 cores; ``--large`` adds the
2.4 GB set of 50 files, ``--sets 50mb`` runs one set, ``--steps`` sets the steps per run).

Data: RETURNN's HDF layout (``inputs`` 40-dim float32 frames, 100-1500 frames per sequence,
frame-level sparse ``classes`` targets, ``seqLengths``, ``seqTags``; written by RETURNN's
``SimpleHDFWriter`` when RETURNN is installed, else by kit's ``write_hdf``), under a temporary
directory that is removed at the end: 50 MB in 1 file, 500 MB in 10 files, 1000 small files
(~260 MB), and with ``--large`` 2.4 GB in 50 files. Page cache warm (the files were just written).

Each (set, loader) runs in a fresh process (so that peak RSS is its own): a compute-bound frame
MLP (one torch thread) trains with batch_size 20000 frames, max_seqs 64, ``laplace:.100``. Printed per run:

- ratio to in-memory (step pairs, the headline): training alternates a step on the loader's next
  batch with a step on the batch before it, by then in memory; per batch, its step through the
  loader over its step in memory, 80 ms apart, so the machine's drift (several % over seconds on
  this 2-core VM) cancels; the median of 200 such pairs, with their quartiles (target <= 1.03x).
  Each loader step takes one batch, so the loader loads the next while that step runs, as in plain
  training; an epoch's first batch is left out (its time is the first-batch column's);
- whole rounds: ``--rounds`` rounds of ``--steps`` steps through the loader, each from a new epoch
  whose first batch is loaded before its clock starts, against the same loader's first batches kept
  in memory, back to back (ABBA order); the median of the rounds' ratios. Round-to-round noise is
  several %, so this column only confirms the headline;
- the ``control`` row has kit's batches in memory on both sides: what this machine's noise and
  memory placement alone give, the resolution of the other rows;
- CPU us/seq: CPU time of the training thread per sequence, loader step over in-memory step
  (median of pairs; the data work the step waits for; target <= 30 % of 589 us, the synchronous
  pipeline's on main);
- first batch: seconds from the pipeline built (dataset opened) to its first batch (target <= 0.05 s
  on the 50 MB set), and the open time before it;
- peak RSS of the process after the loader's first round (before the in-memory batches are built).

Loaders: kit with its defaults (prefetch thread), kit with ``data_prefetch=0`` (on the training
thread, as before), kit with one worker process, a plain ``DataLoader`` over h5py with kit's batch
plan (0 workers), RETURNN's HDFDataset through its torch data pipeline when RETURNN is installed,
and the control (kit's batches loaded before the clock starts).
Results go through :func:`write_results` (prints the table; ``--md FILE`` appends it there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from report import add_write_flag, publish

FEATURES, CLASSES, HIDDEN = 40, 50, 128
BATCH_SIZE, MAX_SEQS, ORDER = 20000, 64, "laplace:.100"
SETS = {  # name: (files, sequences per file)
    "50mb": (1, 390),
    "500mb": (10, 390),
    "1000files": (1000, 2),
    "2.4gb": (50, 375),
}
PAIRS = 200  # step pairs per run (about 16 s)
LOADERS = ["kit", "kit_sync", "kit_worker", "dataloader", "returnn", "control"]


# ---- data ------------------------------------------------------------------------------------


def write_set(root: str, name: str) -> list[str]:
    """RETURNN-layout HDF files of one set: RETURNN's ``SimpleHDFWriter`` when installed (chunked datasets,
    as a RETURNN setup has them), else kit's ``write_hdf`` (the same layout, contiguous)."""
    files, per_file = SETS[name]
    os.makedirs(os.path.join(root, name), exist_ok=True)
    rng = np.random.default_rng(len(name))
    paths = []
    for f in range(files):
        lens = rng.integers(100, 1501, size=per_file)
        seqs = [{"data": rng.standard_normal((t, FEATURES), dtype=np.float32),
                 "classes": rng.integers(0, CLASSES, size=t).astype(np.int32)} for t in lens]
        path = os.path.join(root, name, f"data.{f}.hdf")
        write_hdf_file(path, seqs, [f"f{f}-seq{i}" for i in range(len(seqs))])
        paths.append(path)
    return paths


def write_hdf_file(path: str, seqs: list[dict[str, np.ndarray]], tags: list[str]) -> None:
    if not installed("returnn"):
        from kit.data.hdf import write_hdf

        write_hdf(path, seqs, tags=tags)
        return
    from returnn.datasets.hdf import SimpleHDFWriter  # type: ignore[import-untyped]

    writer = SimpleHDFWriter(path, dim=FEATURES, ndim=2, extra_type={"classes": (CLASSES, 1, "int32")})
    for seq, tag in zip(seqs, tags):
        t = len(seq["classes"])
        writer.insert_batch(seq["data"][None], seq_len={0: [t]}, seq_tag=[tag], extra={"classes": seq["classes"][None]})
    writer.close()


# ---- loaders: each yields (x [B,T,F] float32, y [B,T] int64, lengths [B], num_seqs) ------------------


def kit_loader(files: list[str], **changes: Any) -> tuple[Callable[[], Iterator[Any]], float, Any]:
    from kit.data import HDFDataset, Pipeline

    started = time.perf_counter()
    ds = HDFDataset(files, seq_ordering=ORDER)
    pipe = Pipeline(ds, extern_data={"data": {"shape": (None, FEATURES)}, "classes": {"shape": (None,),
                    "sparse_dim": CLASSES}}, batch_size=BATCH_SIZE, max_seqs=MAX_SEQS, **changes)
    opened = time.perf_counter() - started

    def batches() -> Iterator[Any]:
        pipe.set_epoch(1)
        for b in pipe:
            yield b["data"].tensor, b["classes"].tensor, b["classes"].lengths, b.num_seqs

    return batches, opened, pipe


def dataloader_loader(files: list[str]) -> tuple[Callable[[], Iterator[Any]], float, Any]:
    """A plain DataLoader over h5py, 0 workers, with kit's batch plan (what a user would write)."""
    import h5py  # type: ignore[import-untyped]
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from kit.data import HDFDataset, Pipeline

    started = time.perf_counter()
    handles = [h5py.File(f, "r") for f in files]
    where = []
    for f, h in enumerate(handles):
        lens = h["seqLengths"][:, 0]
        starts = np.concatenate([[0], np.cumsum(lens)])
        where += [(f, int(starts[i]), int(starts[i + 1])) for i in range(len(lens))]

    class Items(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(where)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            f, a, b = where[i]
            h = handles[f]
            return torch.from_numpy(h["inputs"][a:b]), torch.from_numpy(h["targets/data/classes"][a:b])

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        xs, ys = zip(*items)
        return (pad_sequence(list(xs), batch_first=True), pad_sequence(list(ys), batch_first=True).long(),
                torch.tensor([len(y) for y in ys]), len(ys))

    plan_pipe = Pipeline(HDFDataset(files, seq_ordering=ORDER), batch_size=BATCH_SIZE, max_seqs=MAX_SEQS)
    plan = [[int(e[0]) for e in batch] for batch in plan_pipe.plan()]
    loader = torch.utils.data.DataLoader(Items(), batch_sampler=plan, collate_fn=collate, num_workers=0)
    opened = time.perf_counter() - started

    def batches() -> Iterator[Any]:
        yield from loader

    return batches, opened, None


def returnn_loader(files: list[str]) -> tuple[Callable[[], Iterator[Any]], float, Any]:
    """RETURNN's HDFDataset through its torch data pipeline (in-process, as its engine builds it)."""
    import torch
    from returnn.config import Config, global_config_ctx  # type: ignore[import-untyped]
    from returnn.datasets.hdf import HDFDataset  # type: ignore[import-untyped]
    from returnn.torch.data import pipeline as rp  # type: ignore[import-untyped]
    from returnn.torch.data import returnn_dataset_wrapper as rw  # type: ignore[import-untyped]

    started = time.perf_counter()
    with global_config_ctx(Config({"backend": "torch"})):
        ds = HDFDataset(files=files, seq_ordering=ORDER, use_cache_manager=False)
        ds.initialize()
    opened = time.perf_counter() - started

    def batches() -> Iterator[Any]:
        with global_config_ctx(Config({"backend": "torch"})):
            ds.init_seq_order(epoch=1)
            pipe = rp.BatchingIterDataPipe(rw.ReturnnDatasetIterDataPipe(ds), batch_size=BATCH_SIZE,
                                           max_seqs=MAX_SEQS)
            loader = torch.utils.data.DataLoader(pipe, batch_size=None, collate_fn=rp.collate_batch, num_workers=0)
            for b in loader:
                yield b["data"], b["classes"].long(), b["classes:seq_len"], int(b["classes:seq_len"].shape[0])

    return batches, opened, None


def control_loader(files: list[str], steps: int) -> tuple[Callable[[], Iterator[Any]], float, Any]:
    """The control: kit's batches loaded into memory before the clock starts, so its ratio to the in-memory
    run (the same batches) is the machine's noise on this run, the resolution of the other rows."""
    batches, opened, pipe = kit_loader(files, prefetch=0)
    kept = [b for _, b in zip(range(steps), batches())]
    pipe.close()
    return lambda: iter(kept), opened, None


def make_loader(kind: str, files: list[str], steps: int) -> tuple[Callable[[], Iterator[Any]], float, Any]:
    if kind == "control":
        return control_loader(files, steps)
    if kind == "kit":
        return kit_loader(files)
    if kind == "kit_sync":
        return kit_loader(files, prefetch=0)
    if kind == "kit_worker":
        return kit_loader(files, num_workers=1)
    if kind == "dataloader":
        return dataloader_loader(files)
    if kind == "returnn":
        return returnn_loader(files)
    raise ValueError(kind)


# ---- one run (a child process) ------------------------------------------------------------------


def make_model() -> tuple[Any, Any]:
    """A frame MLP (the same initial weights each time) and its optimizer."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model: Any, opt: Any, batch: Any) -> int:
    """One training step on ``batch``; its number of sequences."""
    import torch

    x, y, lengths, n = batch
    mask = torch.arange(y.shape[1])[None, :] < lengths[:, None]
    ce = torch.nn.functional.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
    loss = torch.where(mask, ce, 0).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return int(n)


def train(batches: Iterator[Any], steps: int) -> tuple[float, float, int]:
    """``steps`` steps of a frame MLP: (wall seconds, training thread CPU seconds, sequences)."""
    model, opt = make_model()
    wall, cpu, seqs = time.perf_counter(), time.thread_time(), 0
    for _, batch in zip(range(steps), batches):
        seqs += step(model, opt, batch)
    return time.perf_counter() - wall, time.thread_time() - cpu, seqs


def step_pairs(batches: Callable[[], Iterator[Any]], pairs: int) -> tuple[list[float], list[float]]:
    """Training that alternates a step on the loader's next batch with a step on the batch before it, by then in
    memory: each batch's (wall, CPU) ratio through the loader to in memory, 80 ms apart (the machine's drift,
    several % over seconds, cancels; a whole round of 20 steps cannot resolve 1 %). Each loader step takes one batch,
    so the loader loads one while that step runs, as in plain training; an epoch's first batch (loaded on the
    training thread) is left out."""
    model, opt = make_model()

    def endless() -> Iterator[tuple[Any, bool]]:
        while True:
            yield from ((b, i == 0) for i, b in enumerate(batches()))

    source, walls, cpus = endless(), [], []
    prev: tuple[Any, bool, float, float] | None = None
    while len(walls) < pairs:
        wall, cpu = time.perf_counter(), time.thread_time()
        batch, first = next(source)
        step(model, opt, batch)
        now = (batch, first, time.perf_counter() - wall, time.thread_time() - cpu)
        if prev is not None and not prev[1]:
            wall, cpu = time.perf_counter(), time.thread_time()
            step(model, opt, prev[0])
            walls.append(prev[2] / (time.perf_counter() - wall))
            cpus.append(prev[3] - (time.thread_time() - cpu))
        prev = now
    return walls, cpus


def child(kind: str, files: list[str], steps: int, rounds: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    warm = (torch.randn(20, 1000, FEATURES), torch.randint(0, CLASSES, (20, 1000)), torch.full((20,), 1000), 20)
    train(iter([warm] * 3), 3)  # the model's first steps (allocator, autograd) before any timing
    batches, opened, closable = make_loader(kind, files, steps)
    started = time.perf_counter()
    it = batches()
    first = next(it)
    first_batch = time.perf_counter() - started

    def begun() -> Iterator[Any]:
        """A new epoch whose first batch is already loaded (its time is the first-batch column's)."""
        it = batches()
        return itertools.chain([next(it)], it)

    runs = [train(itertools.chain([first], it), steps)]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kept = [b for _, b in zip(range(steps), batches())]  # the same loader's batches, in memory
    mem = [train(iter(kept), steps)]
    for i in range(1, rounds):  # interleaved pairs: the machine's speed drifts under a run, so every other pair
        if i % 2:  # runs the in-memory side first (ABBA order: a drift within a pair does not favour one side)
            mem.append(train(iter(kept), steps))
            runs.append(train(begun(), steps))
        else:
            runs.append(train(begun(), steps))
            mem.append(train(iter(kept), steps))
    pairs, cpus = step_pairs(batches, PAIRS)
    if closable is not None:
        closable.close()
    # whole rounds: the median of the back-to-back pairs' ratios (a pair shares the machine's state, whose speed
    # drifts by several % over a run)
    rounds_ratio = statistics.median(r[0] / m[0] for r, m in zip(runs, mem))
    seqs_per_batch = runs[0][2] / steps
    wall, seqs = statistics.median(r[0] for r in runs), runs[0][2]
    return {"kind": kind, "open_s": opened, "first_batch_s": first_batch, "seqs": seqs, "wall_s": wall,
            "ratio": statistics.median(pairs), "quartiles": statistics.quantiles(pairs, n=4)[::2],
            "rounds_ratio": rounds_ratio, "cpu_us_per_seq": 1e6 * statistics.median(cpus) / seqs_per_batch,
            "seqs_per_s": seqs / wall, "peak_rss_mb": rss}


def run_child(kind: str, files: list[str], steps: int, rounds: int) -> dict[str, Any] | str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(files, f)
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", kind, f.name, str(steps), str(rounds)], capture_output=True,
                              text=True, env=env, timeout=900)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the table ----------------------------------------------------------------------------------


def installed(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False
    return True


def table(rows: list[tuple[str, str, dict[str, Any] | str]]) -> str:
    lines = ["| set | loader | ratio to in-memory (step pairs) | its quartiles | whole rounds | CPU µs/seq on the "
             "training thread | seqs/s | first batch | open | peak RSS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, kind, r in rows:
        if isinstance(r, str):
            lines.append(f"| {name} | {kind} | {r} | | | | | | | |")
            continue
        q1, q3 = r["quartiles"]
        lines.append(f"| {name} | {kind} | {r['ratio']:.3f}x | {q1:.3f}-{q3:.3f} | {r['rounds_ratio']:.3f}x | "
                     f"{r['cpu_us_per_seq']:.0f} | {r['seqs_per_s']:.0f} | {r['first_batch_s']:.3f} s | "
                     f"{r['open_s']:.3f} s | {r['peak_rss_mb']:.0f} MB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="50mb,500mb,1000files", help=f"comma-separated, of {list(SETS)}")
    ap.add_argument("--large", action="store_true", help="add the 2.4 GB set of 50 files (disk and ~10 more minutes)")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10, help="whole rounds per run (ABBA order)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    add_write_flag(ap)
    args = ap.parse_args()
    if args.child:
        kind, files_json, steps, rounds = args.child
        with open(files_json, encoding="utf-8") as f:
            print(json.dumps(child(kind, json.load(f), int(steps), int(rounds))))
        return
    names = args.sets.split(",") + (["2.4gb"] if args.large else [])
    kinds = [k for k in args.loaders.split(",") if k != "returnn" or installed("returnn")]
    root = tempfile.mkdtemp(prefix="kit-data-scale-")
    rows: list[tuple[str, str, dict[str, Any] | str]] = []
    try:
        for name in names:
            started = time.perf_counter()
            files = write_set(root, name)
            size = sum(os.path.getsize(p) for p in files) / 1e6
            print(f"{name}: {len(files)} files, {size:.0f} MB written in {time.perf_counter() - started:.1f} s",
                  flush=True)
            for kind in kinds:
                rows.append((f"{name} ({len(files)} files, {size:.0f} MB)", kind, run_child(kind, files, args.steps, args.rounds)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
            shutil.rmtree(os.path.join(root, name))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "returnn" in args.loaders.split(",") and "returnn" not in kinds:
        print("(RETURNN is not installed: its row is left out)")
    text = table(rows)
    print(text)
    publish(args, "data_scale", text, notes=(
        f"one torch thread; ratio: each batch's training step through the loader over its step in memory 80 ms later, "
        f"median of {PAIRS} such pairs (quartiles beside it); whole rounds: median of {args.rounds} back-to-back rounds "
        f"of {args.steps} steps (ABBA order); control: kit's batches in memory on both sides, the noise of this run; "
        "CPU µs/seq: CPU time on the training thread per sequence, loader step over in-memory step"))


if __name__ == "__main__":
    main()
