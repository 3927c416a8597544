"""Host work per step, counted instead of timed: lines of kit's code and Python calls per train step.

Run: ``python benchmarks/step_lines.py [--steps N] [--top K]``.

On an overhead-bound model kit's extra time per step is many small pieces of Python, each of
which costs about a microsecond with the caches the model's compute has just evicted — and
this machine's speed drifts by ±25 %, so timing resolves a few percent only in long,
interleaved runs (``end_to_end.py``). Counting is exact and repeatable: ``sys.settrace``
counts every line of ``kit/`` run during ``N`` steps of ``end_to_end.py``'s MLP workload
(kit's pipeline, step, guard, history and session loop, through ``Session.train_steps``),
and every Python call in the whole process; the hand-written loop over pre-collated batches
is counted the same way in the same run, as the baseline of the calls. The numbers drop
when kit's per-step work does, whatever the machine is doing; the tracer itself makes the
run slow, so nothing here is a time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import end_to_end as e  # noqa: E402
from report import Table, add_write_flag, publish  # noqa: E402

KIT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kit") + os.sep


class Counts:
    """Lines of kit's code per function, and Python calls per kind (kit, torch, other)."""

    def __init__(self) -> None:
        self.lines: collections.Counter[tuple[str, str]] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def tracer(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        path = frame.f_code.co_filename
        if event == "call":
            self.calls["kit" if path.startswith(KIT_DIR) else "torch" if f"{os.sep}torch{os.sep}" in path
                       else "other"] += 1
        if not path.startswith(KIT_DIR):
            return None
        key = (os.path.relpath(path, os.path.dirname(KIT_DIR.rstrip(os.sep))), frame.f_code.co_name)

        def local(_frame: FrameType, ev: str, _arg: Any) -> Any:
            if ev == "line":
                self.lines[key] += 1
            return local

        return local


def count(run: Any, steps: int) -> Counts:
    counts = Counts()
    sys.settrace(counts.tracer)
    try:
        run.run(steps)
    finally:
        sys.settrace(None)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=640, help="steps counted per variant (default 640: ten history reads)")
    ap.add_argument("--top", type=int, default=12, help="kit functions listed per variant")
    add_write_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = e.WORKLOADS["mlp"]
    runs = e.contenders(w)
    names = ["loop, pre-collated", "kit ArrayDataset, guard off", "kit ArrayDataset, guard on"]
    for name in names:
        runs[name].run(70)  # past the first block, the first history read and the optimizer's state
    results = {name: count(runs[name], args.steps) for name in names}
    base_calls = sum(results[names[0]].calls.values()) / args.steps
    print(f"{w.name}: per step, over {args.steps} steps (sys.settrace; counts, not times)")
    print(f"  {'variant':30} {'kit lines':>10} {'kit calls':>10} {'all Python calls':>17} {'ratio to the loop':>18}")
    table = Table("variant", "kit lines / step", "kit calls / step", "all Python calls / step", "ratio to the loop")
    for name, c in results.items():
        calls = sum(c.calls.values()) / args.steps
        row = (name, f"{sum(c.lines.values()) / args.steps:.1f}", f"{c.calls['kit'] / args.steps:.1f}",
               f"{calls:.1f}", f"{calls / base_calls:.3f}")
        table.add(*row)
        print(f"  {row[0]:30} {row[1]:>10} {row[2]:>10} {row[3]:>17} {row[4]:>18}")
    for name in names[1:]:
        print(f"\n  {name}: the kit functions with the most lines per step")
        for (path, fn), n in results[name].lines.most_common(args.top):
            print(f"    {n / args.steps:7.1f}  {path}:{fn}")
    publish(args, "step_lines", table, notes=(
        f"{w.name}, {args.steps} steps per variant counted with `sys.settrace` (counts, not times: exact and "
        "repeatable where timing on a noisy machine is not). kit's variants run through `Session.train_steps` "
        "on an `ArrayDataset`."))


if __name__ == "__main__":
    main()
