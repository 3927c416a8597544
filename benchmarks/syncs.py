"""Host reads per train step: the kit engine vs a RETURNN-style loop.

Run: ``python benchmarks/syncs.py [--steps N]``. A ``TorchDispatchMode`` counts the ops
that hand a tensor's value to Python (``aten._local_scalar_dense``, ``aten.item``,
``aten.is_nonzero``, ``aten.equal``) — on an accelerator each is a device→host sync that
stalls the host until the device's queue has drained. Counted: the train step itself inside
one train call (as ``Session.train_steps`` runs it), after the first step of the epoch (which
plans the data); the next batch is loaded
before counting, since loading builds host tensors from numpy. Reads from inside
``torch.optim`` are shown apart: torch's Adam reads its step counter, a host tensor
(no device sync unless ``capturable``/``fused``), once per parameter per update.

The RETURNN-style loop does what RETURNN's engine does per step: ``float()`` of each
loss' summed value and of its inverse norm factor.
"""

from __future__ import annotations

import argparse
import traceback

import torch
from report import Table, add_write_flag, publish
from torch.utils._python_dispatch import TorchDispatchMode

import kit
from kit.data import Task12AXDataset, batches
from kit.engine.engine import Engine

READ_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.in_optim = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READ_OPS:
            self.total += 1
            if any("/torch/optim/" in f.filename for f in traceback.extract_stack()):
                self.in_optim += 1
        return func(*args, **(kwargs or {}))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(9, 32)
        self.out = torch.nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def losses(model: torch.nn.Module, batch: kit.Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """name -> (per-frame values, mask, as_error): a CE loss and a frame error rate."""
    classes = batch["classes"]
    logits = model(batch["data"].tensor)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
    fer = (logits.argmax(-1) != classes.tensor).float()
    return {"ce": (ce, classes.mask(), False), "fer": (fer, classes.mask(), True)}


def kit_train_step(*, model, extern_data, **_kwargs):
    ctx = kit.get_run_ctx()
    for name, (values, mask, as_error) in losses(model, extern_data).items():
        ctx.mark_as_loss(values, name, mask=mask, as_error=as_error)


DATA = Task12AXDataset(200, seed=1)
BATCHING = {"batch_size": 600, "max_seqs": 10}


def count_kit(steps: int, **config) -> tuple[float, float]:
    engine = Engine(
        kit.Config(
            get_model=lambda **_: Model(),
            train_step=kit_train_step,
            train=DATA,
            extern_data=DATA.extern_data,
            learning_rate=1e-3,
            log_every_n_steps=10**9,
            device="cpu",
            **BATCHING,
            **config,
        )
    )
    engine.train_step()  # plans the epoch
    pipeline, mode = engine._training.pipeline, HostReads()
    with engine.driver_call():  # one train call (Session.train_steps), read when it ends
        for _ in range(steps):
            engine._training.pipeline = iter([next(pipeline)])
            with mode:
                engine.train_step()
    engine._training.pipeline = pipeline
    return mode.total / steps, mode.in_optim / steps


def count_returnn_style(steps: int, optimizer: str) -> tuple[float, float]:
    model = Model()
    opt = (
        torch.optim.Adam(model.parameters())
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    )
    it = iter(batches(DATA, extern_data=DATA.extern_data, **BATCHING))
    sums: dict[str, float] = {}
    mode = HostReads()
    for _ in range(steps):
        batch = next(it)
        with mode:
            opt.zero_grad()
            marked = losses(model, batch)
            total = 0
            for name, (values, mask, as_error) in marked.items():
                loss_sum = torch.where(mask, values, 0).sum()
                norm = mask.sum()
                # RETURNN: float(loss.get_summed_loss()...cpu()) and float(inv_norm_factor) per loss
                sums[name] = sums.get(name, 0.0) + float(loss_sum.detach().cpu()) / float(norm)
                if not as_error:
                    total = total + loss_sum
            total.backward()
            opt.step()
    return mode.total / steps, mode.in_optim / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    add_write_flag(ap)
    args = ap.parse_args()
    sgd = {"class": "sgd", "momentum": 0.9}
    rows = [
        (
            "kit",
            "sgd+momentum",
            "off",
            count_kit(args.steps, optimizer=sgd, stop_on_nonfinite_train_score=False),
        ),
        ("kit", "sgd+momentum", "immediate", count_kit(args.steps, optimizer=sgd)),
        ("kit", "sgd+momentum", "deferred", count_kit(args.steps, optimizer=sgd, nonfinite_check="deferred")),
        (
            "kit, accum 2",
            "sgd+momentum",
            "deferred",
            count_kit(args.steps, optimizer=sgd, accum_grad_multiple_step=2, nonfinite_check="deferred"),
        ),
        (
            "kit",
            "adam",
            "off",
            count_kit(args.steps, optimizer={"class": "adam"}, stop_on_nonfinite_train_score=False),
        ),
        ("kit", "adam", "deferred", count_kit(args.steps, optimizer={"class": "adam"}, nonfinite_check="deferred")),
        (
            "kit",
            "adam fused",
            "deferred",
            count_kit(args.steps, optimizer={"class": "adam", "fused": True}, nonfinite_check="deferred"),
        ),
        (
            "kit, fp16 + GradScaler",
            "sgd+momentum",
            "deferred",
            count_kit(args.steps, optimizer=sgd, torch_amp="float16", nonfinite_check="deferred"),
        ),
        ("RETURNN-style float() per loss", "sgd+momentum", "-", count_returnn_style(args.steps, "sgd")),
        ("RETURNN-style float() per loss", "adam", "-", count_returnn_style(args.steps, "adam")),
    ]
    print(f"host reads per train step (2 losses: ce, fer; mean over {args.steps} steps after the first)")
    print(f"  {'loop':<32} {'optimizer':<14} {'guard':<10} {'reads/step':>10} {'of which torch.optim':>21}")
    for loop, opt, guard, (total, in_optim) in rows:
        print(f"  {loop:<32} {opt:<14} {guard:<10} {total:10.1f} {in_optim:21.1f}")
    print(
        "\n  kit outside torch.optim: 0 reads with the guard off and with the deferred guard (an accelerator's"
    )
    print("  default: one read when the train call ends); the immediate guard (the CPU default, where the flag")
    print("  is host memory) reads once per micro-batch. float16's GradScaler adds torch's own found-inf read")
    print("  in scaler.step(); torch's non-fused Adam reads its host step counters (fused Adam does not).")
    table = Table("loop", "optimizer", "guard", "host reads / step", "of which in torch.optim")
    for loop, opt, guard, (total, in_optim) in rows:
        table.add(loop, opt, guard, f"{total:.1f}", f"{in_optim:.1f}")
    publish(args, "syncs", table, notes=(
        f"Two losses (ce, fer); mean over {args.steps} steps after the first. The deferred guard reads its flag "
        "once when the train call ends; the immediate guard (the CPU default, where the flag is host memory) "
        "once per micro-batch. float16's GradScaler adds torch's own found-inf read in `scaler.step()`; "
        "torch's non-fused Adam reads its host step counters."))


if __name__ == "__main__":
    main()
