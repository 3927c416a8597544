"""A tiny model with dropout, a tiny sequence task, and a ready-made config for engine tests."""

from __future__ import annotations

from typing import Any

import torch

import kit
from kit.data import Task12AXDataset


class TinyModel(torch.nn.Module):
    """Per-frame MLP with dropout: padding-invariant, so split batches give identical outputs."""

    def __init__(self, hidden: int = 16, dropout: float = 0.2):
        super().__init__()
        self.inp = torch.nn.Linear(9, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.inp(x))))


def get_model(*, epoch: int, step: int, **_kwargs: Any) -> torch.nn.Module:
    return TinyModel()


def train_step(*, model: torch.nn.Module, extern_data: kit.Batch, **_kwargs: Any) -> None:
    data, classes = extern_data["data"], extern_data["classes"]
    logits = model(data.tensor)
    mask = classes.mask()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), classes.tensor, reduction="none")
    ctx = kit.get_run_ctx()
    ctx.mark_as_loss(ce, "ce", mask=mask)
    ctx.mark_as_loss((logits.argmax(-1) != classes.tensor).float(), "fer", mask=mask, as_error=True)


def forward_step(*, model: torch.nn.Module, extern_data: kit.Batch, **_kwargs: Any) -> None:
    data = extern_data["data"]
    kit.get_run_ctx().mark_as_output(model(data.tensor), "logits", lengths=data.lengths)


def tiny_config(model: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Config keys of a small, fast, deterministic training run (3 epochs, ~12 steps each)."""
    cfg: dict[str, Any] = dict(
        get_model=get_model,
        train_step=train_step,
        forward_step=forward_step,
        extern_data=Task12AXDataset.extern_data,
        # random_seed_offset 8: RETURNN's random orders give 19 batches in each of epochs 1-5 (tests count steps)
        train=Task12AXDataset(120, seed=1, seq_ordering="random", random_seed_offset=8),
        dev=Task12AXDataset(30, seed=2),
        batch_size=600,
        max_seqs=10,
        optimizer={"class": "adam"},
        learning_rate=1e-2,
        num_epochs=3,
        log_every_n_steps=1000,
    )
    if model is not None:
        cfg["model"] = model
    cfg.update(overrides)
    return cfg


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        for name, v in sa[k].items():
            w = sb[k][name]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True
