"""``import kit`` on top of ``import torch``: seconds added, median of fresh processes.

Run: ``python benchmarks/import_time.py [--repeats N]``. Each repeat starts a new Python
process that imports torch, then the kit names below, timing each import inside the
process (interpreter start-up is not counted). Target: ``import kit`` adds ≤ 0.15 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from report import Table, add_write_flag, publish

# what a user's first cell does, each step timed after the previous one
STEPS = {
    "import torch": "import torch",
    "import kit": "import kit",
    "kit.Session (engine, data, run ctx)": "kit.Session",
    "kit.cli": "import kit.cli",
}

PROBE = """
import json, time
t = {}
for name, code in STEPS.items():
    t0 = time.perf_counter()
    exec(code)
    t[name] = time.perf_counter() - t0
print(json.dumps(t))
"""


def one_run() -> dict[str, float]:
    code = f"STEPS = {STEPS!r}\n{PROBE}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=11)
    add_write_flag(ap)
    args = ap.parse_args()
    runs = [one_run() for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in STEPS}
    print(f"{sys.executable}: median of {args.repeats} fresh processes, each import timed after the previous")
    print(f"  {'step':<38} {'seconds':>8}")
    for name in STEPS:
        print(f"  {name:<38} {med[name]:8.3f}")
    added = med["import kit"]
    print(
        f"\n  import kit over import torch: {added:.3f} s  (target ≤ 0.15 s: {'ok' if added <= 0.15 else 'MISSED'})"
    )
    print(
        f"  import kit + kit.Session over import torch: {added + med['kit.Session (engine, data, run ctx)']:.3f} s"
    )
    table = Table("step (each timed after the previous)", "seconds, median")
    for name in STEPS:
        table.add(name, f"{med[name]:.3f}")
    publish(args, "import_time", table, notes=f"Median of {args.repeats} fresh processes; interpreter start-up not "
            f"counted. `import kit` over `import torch`: {added:.3f} s (target ≤ 0.15 s: "
            f"{'met' if added <= 0.15 else 'missed'}).")


if __name__ == "__main__":
    main()
