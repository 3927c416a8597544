"""Reading a large RETURNN learning-rate file: kit's parser vs ``ast.parse`` of the same text.

Run: ``python benchmarks/score_file.py [--mb 16] [--repeats 3]``. Writes a legacy file of about
``--mb`` MB (one ``EpochData`` row per epoch with six scores and a meta entry, as RETURNN writes
them), then in fresh subprocesses, interleaved, times ``ScoreTable.load`` and ``ast.parse`` (what
kit used before: 26 s and 2.2 GB for 16 MB) in process CPU time and reads each one's peak resident
memory. Prints
medians, the memory as a multiple of the file size, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from report import Table, add_write_flag, publish

_CHILD = r"""
import json, resource, sys, time
path, how = sys.argv[1], sys.argv[2]
if how == "kit":
    from kit.scores import ScoreTable
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.process_time()
    n = len(ScoreTable.load(path).epochs)
else:
    import ast
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.process_time()
    with open(path, encoding="utf-8") as f:
        n = len(ast.parse(f.read(), mode="eval").body.keys)
secs = time.process_time() - t  # CPU time: the machine may be shared
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"secs": secs, "extra_kib": peak - before, "epochs": n}))
"""


def write_legacy_file(path: str, megabytes: float) -> int:
    """A RETURNN-style learning-rate file of about ``megabytes`` MB; returns its size in bytes."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n")
        epoch, size = 1, 2
        while size < megabytes * 1e6:
            row = (f"  {epoch}: EpochData(learningRate={1e-3 / (1 + epoch % 7):.6g}, error={{\n"
                   f"    'dev_error': {0.3 + epoch % 13 / 100:.6f}, 'dev_score': {1.2 + epoch % 11 / 10:.6f},\n"
                   f"    'devtrain_error': {0.2 + epoch % 5 / 100:.6f}, 'devtrain_score': {0.9:.6f},\n"
                   f"    'train_error': {0.25:.6f}, 'train_score': {1.1 + epoch % 3 / 10:.6f},\n"
                   f"    ':meta:effective_learning_rate': {1e-3:.6g},\n  }}),\n")
            f.write(row)
            size += len(row)
            epoch += 1
        f.write("}\n")
    return os.path.getsize(path)


def run_child(path: str, how: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _CHILD, path, how], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    add_write_flag(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "learning_rates")
        size = write_legacy_file(path, args.mb)
        results: dict[str, list[dict]] = {"kit": [], "ast.parse": []}
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            for how in results:
                results[how].append(run_child(path, "kit" if how == "kit" else "ast"))
    print(f"legacy file: {size / 1e6:.1f} MB, {results['kit'][0]['epochs']} epochs, {args.repeats} runs each")
    med = {how: (statistics.median(r["secs"] for r in rs), statistics.median(r["extra_kib"] for r in rs) * 1024)
           for how, rs in results.items()}
    for how, (secs, mem) in med.items():
        print(f"  {how:10s} {secs:7.2f} s CPU   peak memory +{mem / 1e6:7.0f} MB ({mem / size:5.1f}x the file)")
    (ks, km), (bs, bm) = med["kit"], med["ast.parse"]
    print(f"  kit / ast.parse: time {ks / bs:.2f}x, memory {km / bm:.2f}x")
    table = Table("reader", "CPU s, median", "peak memory added, MB", "× the file")
    for how, (secs, mem) in med.items():
        table.add(how, f"{secs:.2f}", f"{mem / 1e6:.0f}", f"{mem / size:.1f}")
    publish(args, "score_file", table, notes=(
        f"A {size / 1e6:.1f} MB RETURNN learning-rate file of {results['kit'][0]['epochs']} epochs, "
        f"{args.repeats} runs each in fresh processes, interleaved. kit parses it without evaluating it."))


if __name__ == "__main__":
    main()
