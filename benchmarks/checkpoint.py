"""Cost of a kit checkpoint (atomic writes, fsync, sha256 manifest, verified load) vs bare torch.save/load.

Run: ``python benchmarks/checkpoint.py [--repeats N] [--width W] [--dir D]``. A ~100 MB model (fp32 Linear
layers) with a stepped Adam optimizer (its state is twice the model) is saved and loaded both ways,
interleaved, in a temp dir; medians and ratios are printed. The kit save includes fsync of both
files and the directory; the kit load includes sha256 verification of both files. sha256 (about
1.5 GB/s on one core) runs in a helper thread beside the write and beside ``torch.load``, so it
costs less than its own time ("verify": hashing alone, for comparison).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from report import Table, add_write_flag, publish

import kit.checkpoints as ck


def make(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=2240)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument(
        "--dir", default=None, help="where to write (default: the temp dir; e.g. /dev/shm leaves the disk out)"
    )
    add_write_flag(ap)
    args = ap.parse_args()
    model, opt = make(args.width, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.1f} M params = {n_params * 4 / 1e6:.0f} MB fp32; Adam state ~2x that; "
        f"torch {torch.__version__}, {args.repeats} interleaved repeats"
    )
    times: dict[str, list[float]] = {
        k: [] for k in ("bare save", "kit save", "kit nofsync", "bare load", "kit load", "verify")
    }
    with tempfile.TemporaryDirectory(prefix="kit-bench-", dir=args.dir) as d:
        print(f"writing to {d}")
        bare_model, bare_opt = os.path.join(d, "bare.pt"), os.path.join(d, "bare.opt.pt")
        prefix = os.path.join(d, "model")

        def bare_save():
            torch.save({"model": model.state_dict(), "epoch": 1, "step": 1}, bare_model)
            torch.save({"optimizer": opt.state_dict()}, bare_opt)

        def kit_save():
            ck.save(
                prefix,
                epoch=1,
                model_state=model.state_dict(),
                train_state={"optimizer": opt.state_dict()},
                global_train_step=1,
            )

        def bare_load():
            torch.load(bare_model, weights_only=True)
            torch.load(bare_opt, weights_only=True)

        for _ in range(args.repeats):
            times["bare save"].append(timed(bare_save))
            times["kit save"].append(timed(kit_save))
            real_fsync, os.fsync = os.fsync, lambda fd: None  # the same save with fsync stubbed out
            try:
                times["kit nofsync"].append(timed(kit_save))
            finally:
                os.fsync = real_fsync
            ckpt = ck.latest(prefix, verify=False)
            times["bare load"].append(timed(bare_load))
            times["kit load"].append(timed(lambda: ck.load_checkpoint(ckpt)))  # noqa: B023
            times["verify"].append(timed(lambda: ck.verify(ckpt)))  # noqa: B023
        size = ckpt.size
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint size: {size / 1e6:.0f} MB (model + training state)")
    for k, v in med.items():
        print(
            f"  {k:<11} median {v * 1e3:8.1f} ms   ({size / 1e6 / v:7.0f} MB/s)   all: "
            + ", ".join(f"{t * 1e3:.0f}" for t in times[k])
        )
    print(
        f"ratio save kit/bare: {med['kit save'] / med['bare save']:.2f}x "
        f"(atomic rename + fsync + sha256 beside the write); without fsync "
        f"{med['kit nofsync'] / med['bare save']:.2f}x"
    )
    print(
        f"ratio load kit/bare: {med['kit load'] / med['bare load']:.2f}x "
        f"(sha256 beside the load; hashing alone takes {med['verify'] * 1e3:.0f} ms)"
    )
    table = Table("operation", "ms, median", "MB/s", "ratio to bare torch")
    bare = {"bare save": "bare save", "kit save": "bare save", "kit nofsync": "bare save",
            "bare load": "bare load", "kit load": "bare load", "verify": "bare load"}
    for k, v in med.items():
        ratio = "" if k == "verify" else f"{v / med[bare[k]]:.2f}×"
        table.add(k, f"{v * 1e3:.0f}", f"{size / 1e6 / v:.0f}", ratio)
    publish(args, "checkpoint", table, notes=(
        f"A {size / 1e6:.0f} MB checkpoint (a {n_params / 1e6:.1f} M-parameter fp32 model and its Adam state), "
        f"median of {args.repeats} interleaved repeats. kit save: temp file, fsync, rename, sha256 manifest; "
        "kit nofsync: the same with fsync stubbed out; kit load: `weights_only=True` with the sha256 check "
        "beside it; verify: hashing alone."))


if __name__ == "__main__":
    main()
