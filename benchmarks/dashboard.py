"""Cost of watching: the same training with and without the live dashboard attached.

Run: ``python benchmarks/dashboard.py [--rounds N] [--chunk S] [--threads T]``. Two identical
sessions of the 12AX example (LSTM) train in turns, ``--chunk`` steps each per round, the order
alternating per round: one plain, one with ``Dashboard(session, mode="widget")`` attached — the
real widget model, built without a frontend (ipywidgets works without a kernel; its messages go
nowhere). Fine-grained turns make both see the same load on a shared machine. The dashboard's
clock runs only while its own session trains, so it throttles as it would alone. Printed: the
median per-round ratio (watched / plain), the ratio of the totals, and the time spent inside
the dashboard (a figure that load on a shared machine does not blur). Target: <= 1.03. Times
are process CPU time, as in ``overhead.py``: waiting for a core on a shared machine is not counted. A third,
plain session takes its turns too: its ratio to the first (ideally 1.000) shows how much
the machine blurs the ratios of this run.

Not counted: the warm-up steps before the clock starts, which include the dashboard's one-time
cost (matplotlib import, figure, first frame; printed); and, outside a kernel, the sending of widget
messages (tens of microseconds per redraw, at most two redraws per second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from report import Table, add_write_flag, publish

import kit
from kit.widgets import Dashboard

# process CPU time: on a shared machine, time the process waits for a core is not its cost
# (the dashboard draws in the training thread, so its work is counted); the dashboard's own
# throttling still runs on wall time (OwnClock)
CLOCK = time.process_time
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "12ax.py")


class OwnClock:
    """Wall time that advances only between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.total, self.since = 0.0, None

    def start(self) -> None:
        self.since = time.perf_counter()

    def stop(self) -> None:
        self.total += time.perf_counter() - self.since
        self.since = None

    def __call__(self) -> float:
        return self.total + (time.perf_counter() - self.since if self.since is not None else 0.0)


class TimedDashboard(Dashboard):
    """The dashboard, counting the seconds its per-step work takes (all its drawing happens there)."""

    inside = 0.0

    def _on_step_end(self, result, **payload) -> None:
        t = CLOCK()
        try:
            super()._on_step_end(result, **payload)
        finally:
            self.inside += CLOCK() - t


def make_session(num_steps: int) -> kit.Session:
    return kit.Session.from_config(
        EXAMPLE,
        model=None,
        num_epochs=100,
        log_every_n_steps=10**9,
        cleanup_old_models=None,
        train={
            "class": "Task12AXDataset",
            "num_seqs": 10 * num_steps + 10,  # <= 10 seqs per batch: the epoch does not end meanwhile
            "seed": 1,
            "seq_ordering": "laplace:.10",
        },
    )


def timed(session: kit.Session, steps: int, clock: OwnClock | None = None) -> float:
    if clock is not None:
        clock.start()
    t = CLOCK()
    session.train_steps(steps)
    elapsed = CLOCK() - t
    if clock is not None:
        clock.stop()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=100, help="steps per session and round")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier timings on shared CPUs)"
    )
    add_write_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.pop("KIT_TEST", None)
    print(
        f"12AX LSTM example: {args.rounds} rounds x {args.chunk} steps per session, alternating order; "
        f"torch {torch.__version__} ({args.threads} thread(s)), python {sys.version.split()[0]}"
    )
    n = args.rounds * args.chunk + args.warmup
    plain, watched, control = make_session(n), make_session(n), make_session(n)
    clock = OwnClock()
    t = time.perf_counter()
    dash = TimedDashboard(watched, mode="widget")
    dash.clock = clock
    timed(watched, args.warmup, clock)
    dash.inside = 0.0
    print(
        f"dashboard warm-up (with {args.warmup} steps, matplotlib import, first frame): "
        f"{time.perf_counter() - t:.2f}s"
    )
    timed(plain, args.warmup)
    timed(control, args.warmup)
    times: dict[str, list[float]] = {"plain": [], "watched": [], "control": []}
    orders = [("plain", "watched", "control"), ("watched", "control", "plain"), ("control", "plain", "watched")]
    for r in range(args.rounds):
        for name in orders[r % 3] if r % 2 == 0 else reversed(orders[r % 3]):
            if name == "watched":
                times[name].append(timed(watched, args.chunk, clock))
            else:
                times[name].append(timed(plain if name == "plain" else control, args.chunk))
    ratios = [w / p for w, p in zip(times["watched"], times["plain"])]
    control_ratios = [c / p for c, p in zip(times["control"], times["plain"])]
    total_p, total_w = sum(times["plain"]), sum(times["watched"])
    steps = args.rounds * args.chunk
    print(f"plain:   {total_p:.2f} CPU s for {steps} steps ({1000 * total_p / steps:.2f} ms/step)")
    print(
        f"watched: {total_w:.2f} CPU s ({dash.num_refreshes} text redraws, {dash.num_plots} pictures, "
        f"{dash.timeline.num_steps} steps seen)"
    )
    print(
        f"time inside the dashboard: {dash.inside:.3f}s = {100 * dash.inside / total_w:.2f}% of the watched time"
    )
    q = statistics.quantiles(ratios, n=4)
    print(
        f"per-round ratio watched/plain: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}, {q[2]:.3f})"
    )
    print(f"ratio of totals {total_w / total_p:.3f}  (target <= 1.03)")
    print(
        f"noise check, a second plain session / plain: median {statistics.median(control_ratios):.3f}, "
        f"totals {sum(times['control']) / total_p:.3f}"
    )
    table = Table("session", "ms / step", "ratio to plain, median of rounds", "ratio of totals")
    table.add("plain", f"{1000 * total_p / steps:.2f}", "1.000", "1.000")
    table.add("watched by a dashboard", f"{1000 * total_w / steps:.2f}", f"{statistics.median(ratios):.3f}",
              f"{total_w / total_p:.3f}")
    table.add("a second plain session (noise)", f"{1000 * sum(times['control']) / steps:.2f}",
              f"{statistics.median(control_ratios):.3f}", f"{sum(times['control']) / total_p:.3f}")
    publish(args, "dashboard", table, notes=(
        f"The 12AX LSTM example, {args.rounds} rounds of {args.chunk} steps per session in alternating order; "
        f"{dash.num_plots} pictures drawn. Target: ratio of totals ≤ 1.03."))


if __name__ == "__main__":
    main()
