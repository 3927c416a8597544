"""The end-to-end benchmarks' contenders do the same work (same final weights); gpu_check runs anywhere."""

import copy
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import end_to_end as e  # noqa: E402


def small(name):
    w = copy.copy(e.WORKLOADS[name])
    w.num_seqs = w.max_seqs * 3  # three batches: the runs below cross an epoch end
    return w


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_kit_and_the_loops_end_on_the_same_weights(name):
    w = small(name)
    runs = e.contenders(w)
    e.interleave(runs, turn=2, rounds=2, warmup=1)
    base = runs["loop, pre-collated"].model
    for key, run in runs.items():
        assert e.same_weights(base, run.model) == "identical", key
    runs["loop + DataLoader"].run(1)  # negative control: one more step changes the weights
    assert e.same_weights(base, runs["loop + DataLoader"].model) != "identical"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_check_exits_cleanly_without_cuda():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(BENCH))
    out = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and "no CUDA" in out.stdout
