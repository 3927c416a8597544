"""kit among its peers: the end-to-end workloads through Lightning, fastai and RETURNN's engine.

Run: ``python benchmarks/peers.py [--only mlp|transformer] [--rounds N] [--markdown]``
(the peers come with ``pip install -e ".[bench]" torch==<yours>``; RETURNN with
``pip install returnn dm-tree h5py``; a peer that is not installed is listed as such).

The workloads, data, initial weights, batches, masked frame-CE sum and AdamW are those of
``benchmarks/end_to_end.py``; every contender ends on the same weights (checked). Each peer
runs as its users run it — its own training loop fed by its usual data path:

* **Lightning**: a bare ``Trainer`` (no logger, checkpointing, progress bar or model
  summary) over a plain ``DataLoader`` with the padding collate;
* **fastai**: a ``Learner`` over the same ``DataLoader``, without the progress bar
  (its default callbacks stay: they are its training loop);
* **RETURNN**: its PyTorch engine in this process, on a ``StaticDataset`` of the same
  sequences (its own batching gives the same batches).

Interleaving: each framework's own ``fit``/``train`` runs in a thread that pauses at the start
of every k-th step; the main thread lets each contender run k steps in turn and reads the
process CPU time around it (a paused thread uses none). Ratios are per round against the
hand-written loop over pre-collated batches; the table shows their medians.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import end_to_end as e  # noqa: E402  (the shared workloads)
from report import Table, add_write_flag, publish  # noqa: E402


class Stop(Exception):
    """Ends a framework's training loop from inside its step."""


class Stepper:
    """A framework's blocking training call in a thread that pauses before every k-th step.

    ``fit(hook)`` must call ``hook()`` at the start of each train step. ``run(k)`` lets it
    do exactly k steps and returns when it has paused again.
    """

    def __init__(self, fit: Callable[[Callable[[], None]], None], model: torch.nn.Module):
        self.model = model
        self._go, self._paused = threading.Semaphore(0), threading.Semaphore(0)
        self._left, self._stop, self.error = 0, False, None
        self._thread = threading.Thread(target=self._main, args=(fit,), daemon=True)
        self._thread.start()
        self._paused.acquire()  # set-up done, paused before its first step
        if self.error is not None:
            raise self.error

    def _main(self, fit: Callable[[Callable[[], None]], None]) -> None:
        torch.set_num_threads(torch.get_num_threads())
        try:
            fit(self._hook)
        except Stop:
            pass
        except BaseException as exc:  # reported by run(); the bench stops there
            self.error = exc
        self._stop = True
        self._paused.release()

    def _hook(self) -> None:
        if self._left == 0:
            self._paused.release()
            self._go.acquire()
            if self._stop:
                raise Stop
        self._left -= 1

    def run(self, steps: int) -> None:
        if self._stop:
            raise RuntimeError(f"the framework's loop ended early: {self.error!r}")
        self._left = steps
        self._go.release()
        self._paused.acquire()
        if self.error is not None:
            raise RuntimeError(f"the framework's loop failed: {self.error!r}") from self.error

    def close(self) -> None:
        if not self._stop:
            self._stop = True
            self._go.release()
        self._thread.join(timeout=30)


def long_plan(plan: list[list[int]]) -> list[list[int]]:
    """The plan repeated: one framework "epoch" outlasts the benchmark (no epoch-end work in a turn)."""
    return plan * 1000


def padded_loader(dataset: e.SeqTensors, plan: list[list[int]], collate: Callable) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_sampler=long_plan(plan), collate_fn=collate, num_workers=0)


def masked_collate(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y, lengths = e.pad_collate(items)
    return x, y, e.length_mask(lengths, y.shape[1])


# ---- Lightning ------------------------------------------------------------------------------


def lightning_run(model: torch.nn.Module, dataset: e.SeqTensors, plan: list[list[int]]) -> Stepper:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self, net: torch.nn.Module, hook: Callable[[], None]):
            super().__init__()
            self.net, self.hook = net, hook

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.hook()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, mask = batch
            return torch.where(mask, e.frame_ce(self.net, x, y, mask), 0).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.net.parameters(), lr=1e-3)

    def fit(hook: Callable[[], None]) -> None:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            use_distributed_sampler=False, default_root_dir=tempfile.mkdtemp(prefix="kit-bench-pl-"),
        )
        trainer.fit(Module(model, hook), padded_loader(dataset, plan, masked_collate))

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return Stepper(fit, model)


# ---- fastai ---------------------------------------------------------------------------------


def fastai_run(model: torch.nn.Module, dataset: e.SeqTensors, plan: list[list[int]]) -> Stepper:
    from functools import partial

    from fastai.callback.core import Callback, CancelFitException
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper

    def collate(items: list[dict[str, torch.Tensor]]) -> tuple:
        x, y, mask = masked_collate(items)
        return x, mask, (y, mask)  # fastai: inputs (x, mask) to the model, the rest to the loss

    def loss_func(logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, mask = target
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        return torch.where(mask, ce, 0).sum()

    def fit(hook: Callable[[], None]) -> None:
        class Pause(Callback):
            order = -100

            def before_batch(self) -> None:
                try:
                    hook()
                except Stop:
                    raise CancelFitException() from None

        valid = torch.utils.data.DataLoader(dataset, batch_sampler=plan[:1], collate_fn=collate)
        dls = DataLoaders(padded_loader(dataset, plan, collate), valid, device=torch.device("cpu"))
        learn = Learner(dls, model, loss_func=loss_func, opt_func=partial(OptimWrapper, opt=torch.optim.AdamW),
                        lr=1e-3, cbs=[Pause()])
        with learn.no_logging():  # defaults.callbacks has no ProgressCallback unless fastai.callback.progress is imported
            learn.fit(1)

    return Stepper(fit, model)


# ---- RETURNN --------------------------------------------------------------------------------


def returnn_run(model: torch.nn.Module, seqs: list[dict[str, np.ndarray]], w: e.Workload) -> Stepper:
    from returnn.config import Config, global_config_ctx
    from returnn.datasets.generating import StaticDataset
    from returnn.log import log
    from returnn.torch.engine import Engine
    from returnn.util import basic as util

    def train_step(*, model: torch.nn.Module, extern_data: Any, **_: Any) -> None:
        import returnn.frontend as rf

        hook_box[0]()
        data, classes = extern_data["data"], extern_data["classes"]
        x, y = data.raw_tensor, classes.raw_tensor.long()
        lengths = classes.dims[1].dyn_size_ext.raw_tensor
        mask = e.length_mask(lengths, y.shape[1])
        loss = torch.where(mask, e.frame_ce(model, x, y, mask), 0).sum()
        rf.get_run_ctx().mark_as_loss(loss, "ce", dims=())

    hook_box: list[Callable[[], None]] = []
    config = Config({
        "backend": "torch", "device": "cpu", "log_verbosity": 0, "num_epochs": 10**6,
        "extern_data": {"data": {"dim": w.features}, "classes": {"dim": 10, "sparse": True}},
        "get_model": lambda **_: model, "train_step": train_step,
        "batch_size": 10**9, "max_seqs": w.max_seqs, "optimizer": {"class": "adamw"},
        "learning_rate": 1e-3, "torch_dataloader_opts": {"num_workers": 0},
    })

    def fit(hook: Callable[[], None]) -> None:
        hook_box.append(hook)
        log.initialize(verbosity=[0])
        util.BackendEngine.select_engine(engine=util.BackendEngine.Torch)
        data = [{"data": s["data"], "classes": s["classes"].astype(np.int32)} for s in seqs]
        dataset = StaticDataset(data, output_dim={"data": (w.features, 2), "classes": (10, 1)})
        dataset.initialize()
        with global_config_ctx(config):
            engine = Engine(config)
            engine.init_train_from_config(config, train_data=dataset)
            engine.train()

    return Stepper(fit, model)


# ---- the table ------------------------------------------------------------------------------

PEERS: dict[str, tuple[str, Callable[..., Stepper]]] = {
    "Lightning, bare Trainer": ("lightning", lambda m, seqs, items, plan, w: lightning_run(m, items, plan)),
    "fastai Learner, no progress bar": ("fastai", lambda m, seqs, items, plan, w: fastai_run(m, items, plan)),
    "RETURNN engine, in-process": ("returnn", lambda m, seqs, items, plan, w: returnn_run(m, seqs, w)),
}


def installed(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - a broken install (e.g. a CUDA torchvision) counts as missing
        return False
    return True


def contenders(w: e.Workload) -> tuple[dict[str, Any], list[str]]:
    seqs = e.make_seqs(w)
    plan = e.plan_indices(seqs, w)
    torch.manual_seed(0)
    base = w.make_model()
    items = e.SeqTensors(seqs)
    runs: dict[str, Any] = {
        "loop, pre-collated": e.HandLoop(copy.deepcopy(base), e.precollated(seqs, plan)),
        "loop + DataLoader": e.HandLoop(copy.deepcopy(base), e.dataloader_batches(items, plan)),
        "kit, defaults (guard on)": e.KitRun(copy.deepcopy(base), e.ArrayDataset(seqs), w, guard=True),
        "kit, guard off": e.KitRun(copy.deepcopy(base), e.ArrayDataset(seqs), w, guard=False),
    }
    missing = []
    for name, (module, make) in PEERS.items():
        if installed(module):
            runs[name] = make(copy.deepcopy(base), seqs, items, plan, w)
        else:
            missing.append(f"{name}: not installed ({module})")
    return runs, missing


def table(w: e.Workload, times: dict[str, list[float]], runs: dict[str, Any], base: str, markdown: bool) -> str:
    """Print the workload's table (as markdown with ``markdown``); returns the markdown for docs/benchmarks.md."""
    ratios = e.ratios_to(times, base)
    rows = sorted(times, key=lambda k: ratios[k][1])
    out = Table(f"{w.name}, AdamW", "µs/step", "ratio to the pre-collated loop (interquartile)", "weights")
    if markdown:
        print(f"\n| {w.name}, AdamW | µs/step | ratio to the pre-collated loop (interquartile) | weights |")
        print("|---|---|---|---|")
    else:
        print(f"\n{w.name}: {w.turn} steps per turn, {len(times[base])} rounds")
    for name in rows:
        q1, med, q3 = ratios[name]
        weights = "" if name == base else e.same_weights(runs[base].model, runs[name].model)
        us = statistics.median(times[name]) * 1e6
        bold = "**" if name.startswith("kit") else ""
        out.add(f"{bold}{name}{bold}", f"{us:.0f}", f"{bold}{med:.2f}×{bold} ({q1:.2f}–{q3:.2f})", weights)
        if markdown:
            bold = "**" if name.startswith("kit") else ""
            print(f"| {bold}{name}{bold} | {us:.0f} | {bold}{med:.2f}×{bold} ({q1:.2f}–{q3:.2f}) | {weights} |")
        else:
            print(f"  {name:<34} {us:8.0f} µs {med:6.2f}x  ({q1:.2f}-{q3:.2f})  {weights}")
    return out.markdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(e.WORKLOADS))
    ap.add_argument("--rounds", type=int, help="rounds per workload (default: the workload's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown (as docs/benchmarks.md has them)")
    add_write_flag(ap)
    args = ap.parse_args()
    tables = []
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), process CPU time, interleaved turns; medians of per-round ratios")
    for key, w in e.WORKLOADS.items():
        if args.only not in (None, key):
            continue
        runs, missing = contenders(w)
        try:
            times = e.interleave(runs, w.turn, args.rounds or w.rounds)
            tables.append(table(w, times, runs, "loop, pre-collated", args.markdown))
        finally:
            for run in runs.values():
                if isinstance(run, Stepper):
                    run.close()
        for line in missing:
            print(f"  ({line})")
            tables.append(f"({line})")
    if args.only is None:  # the section holds both workloads
        publish(args, "peers", "\n\n".join(tables), notes=(
            f"{torch.get_num_threads()} torch thread(s), process CPU time, interleaved turns; medians of per-round "
            "ratios. Every contender gets the same data, model, initial weights, batches and AdamW."))


if __name__ == "__main__":
    main()
