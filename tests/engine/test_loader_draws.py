"""kit draws from torch's generator what RETURNN's DataLoader draws: checked against torch's own DataLoader."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data

from kit.engine.loader_draws import draw, draws_per_iteration


class Pipe(torch.utils.data.IterDataPipe):  # RETURNN's batching is a datapipe
    def __iter__(self):
        yield from range(2)


class Plain(torch.utils.data.IterableDataset):  # a torch_batching batcher may return a plain one
    def __iter__(self):
        yield from range(2)


def _draws_of(start: torch.Tensor, after: torch.Tensor) -> int:
    """How many int64 draws lead from ``start`` to ``after``."""
    torch.random.set_rng_state(start)
    for count in range(8):
        if torch.equal(torch.random.get_rng_state(), after):
            return count
        draw(1)
    raise AssertionError("not a number of int64 draws")


@pytest.mark.parametrize("datapipe", [True, False])
@pytest.mark.parametrize("opts", [{}, {"num_workers": 0}, {"num_workers": 1, "persistent_workers": False}])
def test_the_draws_are_those_of_torchs_dataloader_under_returnns_defaults(opts, datapipe):
    workers = opts.get("num_workers", 1)
    loader_opts = {"num_workers": workers, "batch_size": None}
    if workers:
        loader_opts.update(persistent_workers=opts.get("persistent_workers", True), multiprocessing_context="fork")
    loader = torch.utils.data.DataLoader(Pipe() if datapipe else Plain(), **loader_opts)
    torch.manual_seed(3)
    try:
        for first in (True, False, False):  # three epochs
            start = torch.random.get_rng_state()
            list(iter(loader))
            assert _draws_of(start, torch.random.get_rng_state()) == draws_per_iteration(opts, first=first,
                                                                                         datapipe=datapipe)
            torch.random.set_rng_state(start)
            draw(draws_per_iteration(opts, first=first, datapipe=datapipe))
    finally:
        del loader


def test_returnns_default_loader_draws_three_then_one():
    assert [draws_per_iteration(None, first=f) for f in (True, False)] == [3, 1]  # negative control: not constant
