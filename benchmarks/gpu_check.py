"""kit on a CUDA GPU: bf16 throughput, host syncs per step, memory figures, a real OOM split.

Run: ``python benchmarks/gpu_check.py`` (well under 3 minutes on one H200). Without CUDA it
says so and exits cleanly (``--dry-run`` runs the throughput and OOM-split checks on the CPU,
with a simulated OOM, to test the script itself). Prints one table:

1. **bf16 autocast throughput**: the Transformer of ``end_to_end.py`` (wider batches) through
   ``Session.train_steps`` with ``torch_amp="bfloat16"``, interleaved with a hand-written
   loop under ``torch.autocast(bfloat16)`` over the same pre-collated batches on the GPU;
   wall time with a ``torch.cuda.synchronize()`` at the end of every turn, median ratio.
2. **host syncs per step**: kit steps under ``torch.cuda.set_sync_debug_mode("warn")``,
   counted per step, guard on (defaults) and guard off; then the same steps under
   ``"error"`` with the guard on, which must pass (0 syncs). The window runs from the end of a
   call's first step to the end of its last (``step_end`` events), so it holds whole steps only:
   the guard's one flag read at the call's return, where the losses are read anyway, is outside,
   and so is the log line (``log_every_n_steps`` set past the window).
3. **memory figures**: what the dashboard shows (``session.memory()``, the engine's meter) against
   ``torch.cuda.memory_stats()`` read at the same moment: allocated and reserved; the last step's peak.
4. **CUDA graph** (``torch_cuda_graph``, float32 with TF32): the same Transformer through
   ``Session.train_steps`` eager and with the whole step captured (every batch full, so no padding
   sequences), interleaved with the hand-written float32 loop; median step-time ratios, and the
   per-step losses of the graphed session against the eager one over the same batches.
5. **optimizer step** (``torch_optimizer_step``, compile + capture, AdamW ``capturable``): per-step losses
   against the eager optimizer step, the phase counters (one eager, one compiled, then replays), and the
   median step-time ratio.
5. **overlap**: step time of Sessions reading the same sequences from HDF files (the prefetch
   thread, pinned batches, ``non_blocking`` copies) and from memory, interleaved, median ratio.
5. **OOM split**: ``Session.forward`` of a batch whose forward really runs out of device
   memory (it allocates a third of the free memory per sequence); with
   ``forward_auto_split_batch_on_oom`` the batch is split until it fits, and the outputs
   equal those of a model that does not allocate.
5. **processes = all GPUs**: ``session.train_steps(k, processes=N)`` with N = the device count (2 in a
   dry run, on the CPU), after CUDA was initialised in this process by the checks before it: the
   workers' start-up, a warm call's steps per second (each rank's), and rank 0's state at home
   (skipped with one device: ``processes=1`` is this process).
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import end_to_end as e  # noqa: E402  (the shared workloads)
from report import Table, command_line, write_section  # noqa: E402

import kit  # noqa: E402

ROWS: list[tuple[str, str, str]] = []  # (check, result, verdict)
DEVICE = "cuda"  # "cpu" in a --dry-run: the checks' own logic, without a GPU


def row(check: str, result: str, ok: bool | None = None) -> None:
    ROWS.append((check, result, "" if ok is None else ("ok" if ok else "FAILED")))


def gpu_workload() -> e.Workload:
    w = copy.copy(e.WORKLOADS["transformer"])
    w.max_seqs, w.num_seqs = 64, 64 * 12  # enough work per step for a GPU
    return w


def session(model: torch.nn.Module, w: e.Workload, **overrides: Any) -> kit.Session:
    opts = {
        "get_model": lambda **_: model, "train_step": e.kit_train_step, "train": e.ArrayDataset(e.make_seqs(w)),
        "extern_data": e.extern_data(w), "batch_size": 10**9, "max_seqs": w.max_seqs,
        "optimizer": {"class": "adamw"}, "learning_rate": 1e-3, "num_epochs": 10**6, "device": DEVICE,
    }
    opts.update(overrides)
    return kit.Session(**opts)


class CudaLoop(e.HandLoop):
    """The hand-written loop on the GPU under bf16 autocast, batches already on the device."""

    def run(self, steps: int) -> None:
        model, opt = self.model, self.opt
        for _ in range(steps):
            x, y, mask = next(self.batches)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                ce = e.frame_ce(model, x, y, mask)
            loss = torch.where(mask, ce.float(), 0).sum()
            loss.backward()
            opt.step()
            self.loss_sum += loss.detach().double()
            self.frames += mask.sum()


def check_throughput(w: e.Workload, rounds: int = 15, turn: int = 8) -> None:
    seqs = e.make_seqs(w)
    plan = e.plan_indices(seqs, w)
    torch.manual_seed(0)
    base = w.make_model()
    ready = [tuple(t.to(DEVICE) for t in b) for b in itertools_take(e.precollated(seqs, plan), len(plan))]
    loop = CudaLoop(copy.deepcopy(base).to(DEVICE), iter_cycle(ready))
    loop.loss_sum, loop.frames = loop.loss_sum.to(DEVICE), loop.frames.to(DEVICE)
    sess = session(copy.deepcopy(base).to(DEVICE), w, torch_amp="bfloat16")

    loop.run(3)
    sess.train_steps(3)
    ratios, per_step = [], []
    for r in range(rounds):  # who goes first alternates
        if r % 2 == 0:
            a = timed(lambda: loop.run(turn))
            b = timed(lambda: sess.train_steps(turn))
        else:
            b = timed(lambda: sess.train_steps(turn))
            a = timed(lambda: loop.run(turn))
        ratios.append(b / a)
        per_step.append(a / turn)
    med = statistics.median(ratios)
    row("bf16 step, kit / hand loop", f"{med:.3f}x (loop {statistics.median(per_step) * 1e3:.2f} ms/step, "
        f"{w.max_seqs} seqs of {w.min_len}-{w.max_len} frames)", med <= 1.05 if DEVICE == "cuda" else None)
    sess.close()


def check_cuda_graph(w: e.Workload, rounds: int = 9, turn: int = 8) -> None:
    """Throughput of the captured step against the eager one and the hand loop; the same losses."""
    w = copy.copy(w)
    w.num_seqs = w.max_seqs * 12  # every batch full: no padding sequences (a zero-length one would attend to nothing)
    seqs = e.make_seqs(w)
    plan = e.plan_indices(seqs, w)
    torch.manual_seed(0)
    base = w.make_model()
    ready = [tuple(t.to(DEVICE) for t in b) for b in itertools_take(e.precollated(seqs, plan), len(plan))]
    loop = e.HandLoop(copy.deepcopy(base).to(DEVICE), iter_cycle(ready))
    loop.loss_sum, loop.frames = loop.loss_sum.to(DEVICE), loop.frames.to(DEVICE)
    graph = {"batch_size_bound": w.max_seqs, "dim_capacity": {"data": w.max_len, "classes": w.max_len}}
    eager_s = session(copy.deepcopy(base).to(DEVICE), w)
    graphed_s = session(copy.deepcopy(base).to(DEVICE), w, torch_cuda_graph=graph)
    losses: dict[str, list[float]] = {"eager": [], "graphed": []}
    for name, sess in (("eager", eager_s), ("graphed", graphed_s)):
        sess.engine.events.on("step_end", lambda result, name=name: losses[name].append(result.losses["ce"]))
        sess.train_steps(4)  # graphed: captured at its first step
    same = max(abs(a - b) / abs(a) for a, b in zip(losses["eager"], losses["graphed"]))
    row("cuda graph: step losses, graphed vs eager", f"max rel diff {same:.1e} over 4 steps", same < 1e-3)

    loop.run(3)
    vs_eager, vs_loop, graphed_ms = [], [], []
    for r in range(rounds):
        order = [("loop", loop.run), ("eager", eager_s.train_steps), ("graphed", graphed_s.train_steps)]
        if r % 2:
            order.reverse()
        t = {name: timed(lambda fn=fn: fn(turn)) for name, fn in order}
        vs_eager.append(t["graphed"] / t["eager"])
        vs_loop.append(t["graphed"] / t["loop"])
        graphed_ms.append(t["graphed"] / turn * 1e3)
    row("cuda graph: step, graphed / kit eager", f"{statistics.median(vs_eager):.3f}x "
        f"(graphed {statistics.median(graphed_ms):.2f} ms/step)", None)
    row("cuda graph: step, graphed / hand loop", f"{statistics.median(vs_loop):.3f}x", None)
    eager_s.close()
    graphed_s.close()


def check_optimizer_step(w: e.Workload, steps: int = 8, rounds: int = 7, turn: int = 8) -> None:
    """``torch_optimizer_step`` (compile + capture, AdamW capturable): the same per-step losses as the eager
    optimizer step (first step eager, second compiled, then captured and replayed); step-time ratio."""
    torch.manual_seed(0)
    base = w.make_model()
    adamw = {"class": "adamw", "capturable": True}
    eager_s = session(copy.deepcopy(base).to(DEVICE), w, optimizer=adamw)
    captured_s = session(copy.deepcopy(base).to(DEVICE), w, optimizer=adamw, torch_optimizer_step={})
    losses: dict[str, list[float]] = {"eager": [], "captured": []}
    for name, sess in (("eager", eager_s), ("captured", captured_s)):
        sess.engine.events.on("step_end", lambda result, name=name: losses[name].append(result.losses["ce"]))
        sess.train_steps(steps)
    runner = captured_s.engine.compiled_optimizer_step
    phases = (runner.eager_steps, runner.compiled_steps, runner.captures, runner.replays)
    same = max(abs(a - b) / abs(a) for a, b in zip(losses["eager"], losses["captured"]))
    row("optimizer step: losses, captured vs eager", f"max rel diff {same:.1e} over {steps} steps; eager, "
        f"compiled, captures, replays {phases}", same < 1e-3 and phases == (1, 1, 1, steps - 2))
    ratios = []
    for r in range(rounds):
        order = [("eager", eager_s), ("captured", captured_s)][:: -1 if r % 2 else 1]
        t = {name: timed(lambda sess=sess: sess.train_steps(turn)) for name, sess in order}
        ratios.append(t["captured"] / t["eager"])
    row("optimizer step: step, captured / eager", f"{statistics.median(ratios):.3f}x", None)
    eager_s.close()
    captured_s.close()


def check_overlap(w: e.Workload, rounds: int = 7, turn: int = 8) -> None:
    """Step time with the data read from HDF files (prefetch thread, pinned, non_blocking copies) against
    the same data in memory (ArrayDataset): the step should not wait for the files (target <= 1.03x)."""
    import tempfile

    from kit.data import HDFDataset
    from kit.data.hdf import write_hdf

    seqs = e.make_seqs(w)
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"d{i}.hdf") for i in range(4)]
        for i, path in enumerate(files):
            write_hdf(path, seqs[i::4], tags=[f"s{i}-{j}" for j in range(len(seqs[i::4]))])
        torch.manual_seed(0)
        base = w.make_model()
        hdf = session(copy.deepcopy(base).to(DEVICE), w, torch_amp="bfloat16", train=HDFDataset(files))
        mem = session(copy.deepcopy(base).to(DEVICE), w, torch_amp="bfloat16")

        def timed(sess: kit.Session) -> float:
            synchronize()
            t = time.perf_counter()
            sess.train_steps(turn)
            synchronize()
            return time.perf_counter() - t

        hdf.train_steps(3)
        mem.train_steps(3)
        ratios, per_step = [], []
        for r in range(rounds):  # who goes first alternates
            if r % 2 == 0:
                a, b = timed(mem), timed(hdf)
            else:
                b, a = timed(hdf), timed(mem)
            ratios.append(b / a)
            per_step.append(a / turn)
        hdf.close()
        mem.close()
    med = statistics.median(ratios)
    row("overlap: step on HDF / in memory", f"{med:.3f}x (in memory {statistics.median(per_step) * 1e3:.2f} ms/step)",
        med <= 1.03 if DEVICE == "cuda" else None)


def timed(fn: Any) -> float:
    """Seconds of ``fn()`` with the device's queue drained before and after."""
    synchronize()
    t = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def itertools_take(it: Any, n: int) -> list[Any]:
    return [next(it) for _ in range(n)]


def iter_cycle(items: list[Any]) -> Any:
    while True:
        yield from items


@contextlib.contextmanager
def sync_mode_between_steps(sess: kit.Session, mode: str, steps: int) -> Iterator[None]:
    """``set_sync_debug_mode(mode)`` from the end of the call's first step to the end of step ``steps + 1``.

    So the window holds ``steps`` whole steps and nothing else: the call's start and the guard's one
    read at the call's return (where the host reads the losses anyway) stay outside, through the
    session's public ``step_end`` event.
    """
    seen = 0

    def on_step_end(**_: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            torch.cuda.set_sync_debug_mode(mode)
        elif seen == steps + 1:
            torch.cuda.set_sync_debug_mode("default")

    sess.on("step_end", on_step_end)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
        sess.off("step_end", on_step_end)


def syncs_per_step(sess: kit.Session, steps: int) -> float:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_mode_between_steps(sess, "warn", steps):
            sess.train_steps(steps + 1)
    return sum("synchroniz" in str(c.message) for c in caught) / steps


def check_syncs(w: e.Workload, steps: int = 20) -> None:
    torch.manual_seed(0)
    base = w.make_model()
    # no per-step log line inside the window: a log line reads the losses (and so the guard's flag) by design
    quiet = {"log_every_n_steps": 10**6}
    for guard in (True, False):
        options = quiet if guard else {**quiet, "stop_on_nonfinite_train_score": False}
        sess = session(copy.deepcopy(base).cuda(), w, **options)
        sess.train_steps(3)  # set-up and the epoch's plan happen outside the count
        n = syncs_per_step(sess, steps)
        row(f"host syncs per step, guard {'on' if guard else 'off'}", f"{n:g}", n == 0 if guard else None)
        if guard:
            what = f'{steps} train steps under set_sync_debug_mode("error"), guard on'
            try:
                with sync_mode_between_steps(sess, "error", steps):
                    sess.train_steps(steps + 1)
                row(what, "passed", True)
            except RuntimeError as exc:
                row(what, f"raised: {str(exc)[:80]}", False)
        sess.close()


def check_memory(w: e.Workload) -> None:
    torch.manual_seed(0)
    sess = session(w.make_model().cuda(), w)
    sess.train_steps(5)
    torch.cuda.synchronize()
    figures = sess.memory()  # what the dashboard shows: the engine's meter, read now
    shown, stats = (figures.columns() if figures is not None else {}), torch.cuda.memory_stats(sess.device)
    pairs = [("memory_allocated", "allocated_bytes.all.current"), ("memory_reserved", "reserved_bytes.all.current")]
    for ours, theirs in pairs:
        got, want = shown.get(ours), stats.get(theirs)
        row(f"dashboard {ours} vs memory_stats {theirs}", f"{got} vs {want}", got == want)
    # the engine closes each step's peak window itself: the last step's peak is at least what it left allocated
    peak, left = shown.get("memory_peak"), shown.get("memory_allocated")
    row("dashboard memory_peak (the last step's) >= memory_allocated after it", f"{peak} vs {left}",
        peak is not None and left is not None and peak >= left)
    sess.close()


class Hog(torch.nn.Module):
    """Per frame 40 → 10, after allocating ``per_seq`` bytes for every sequence of the batch."""

    def __init__(self, per_seq: int):
        super().__init__()
        self.lin, self.per_seq, self.ooms = torch.nn.Linear(40, 10), per_seq, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_seq:
            if x.device.type != "cuda":  # a dry run: the OOM the allocation would give on a GPU of 1 GiB
                if x.shape[0] * self.per_seq > 2**30:
                    self.ooms += 1
                    raise torch.cuda.OutOfMemoryError("dry run: simulated CUDA out of memory")
            else:
                try:
                    hog = torch.empty(x.shape[0] * self.per_seq, dtype=torch.uint8, device=x.device)
                except torch.cuda.OutOfMemoryError:
                    self.ooms += 1
                    raise
                del hog
        return self.lin(x)


def forward_step(*, model: torch.nn.Module, extern_data: kit.Batch, **_: Any) -> None:
    kit.get_run_ctx().mark_as_output(model(extern_data["data"].tensor), "logits")


def check_processes(w: e.Workload, steps: int = 20) -> None:
    n = torch.cuda.device_count() if DEVICE == "cuda" else 2
    if n < 2:
        row("processes = all GPUs", f"skipped: {n} device (processes=1 trains in this process)")
        return
    torch.manual_seed(0)
    sess = session(w.make_model(), w, torch_amp="bfloat16" if DEVICE == "cuda" else None)
    first = sess.train_steps(2, processes=n)  # starts the workers
    started = time.perf_counter()
    result = sess.train_steps(steps, processes=n)
    seconds = time.perf_counter() - started
    # train_steps reports its last step's position; the session's progress is the next step's
    home = result.global_train_step == first.global_train_step + steps == sess.progress.global_train_step - 1
    startup = kit.multiproc.startup_secs(sess) or float("nan")
    row(f"processes={n} (after CUDA init here)", f"start-up {startup:.1f} s, {steps / seconds:.1f} steps/s per rank "
        f"({n} ranks), state home: {'yes' if home else 'NO'}", home)
    sess.close()


def check_oom_split() -> None:
    free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 2**30
    rng = np.random.default_rng(0)
    seqs = [{"data": rng.standard_normal((int(t), 40), dtype=np.float32)} for t in rng.integers(5, 20, 16)]
    data = e.ArrayDataset(seqs)
    outs, ooms = {}, 0
    for name, per_seq in (("plain", 0), ("hog", free // 3)):
        torch.manual_seed(0)
        model = Hog(per_seq)
        sess = kit.Session(get_model=lambda model=model, **_: model, forward_step=forward_step,
                           extern_data={"data": {"shape": (None, 40)}}, batch_size=10**9, max_seqs=16, device=DEVICE)
        try:
            outs[name] = sess.forward(data)
        except torch.cuda.OutOfMemoryError as exc:
            row("forward OOM split", f"not split: {str(exc)[:80]}", False)
            return
        finally:
            sess.close()
        ooms = model.ooms
    same = all(np.array_equal(outs["plain"][t]["logits"], outs["hog"][t]["logits"]) for t in outs["plain"])
    row("forward OOM split (16 seqs, a third of the free memory each)",
        f"{ooms} OOMs split, {len(outs['hog'])} seqs out, outputs {'equal' if same else 'DIFFER'}",
        same and len(outs["hog"]) == 16 and ooms > 0)


def main() -> int:
    global DEVICE
    dry_run = "--dry-run" in sys.argv[1:]
    if not torch.cuda.is_available() and not dry_run:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check. "
              "(--dry-run runs the throughput and OOM-split checks on the CPU, to test the script itself.)")
        return 0
    w = gpu_workload()
    checks = [check_throughput, check_syncs, check_memory, check_cuda_graph, check_optimizer_step, check_processes,
              check_overlap]
    if dry_run:
        DEVICE, checks = "cpu", [check_throughput, check_processes, check_overlap]
        w.max_seqs, w.num_seqs = 4, 4 * 4
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    for check in checks:
        try:
            check(w)
        except Exception as exc:  # one failing check must not hide the others
            row(check.__name__, f"error: {type(exc).__name__}: {str(exc)[:100]}", False)
    try:
        check_oom_split()
    except Exception as exc:
        row("check_oom_split", f"error: {type(exc).__name__}: {str(exc)[:100]}", False)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run (figures mean nothing)"
    print(f"{where}, torch {torch.__version__}, {time.perf_counter() - t0:.0f}s")
    width = max(len(c) for c, _, _ in ROWS)
    for check, result, verdict in ROWS:
        print(f"  {check:<{width}}  {result}  {verdict}")
    if DEVICE == "cuda" and "--no-write" not in sys.argv[1:]:
        table = Table("check", "result", "verdict")
        for check, result, verdict in ROWS:
            table.add(check, result, verdict)
        write_section("gpu_check", table.markdown(), command_line())
    return 1 if any(v == "FAILED" for _, _, v in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
